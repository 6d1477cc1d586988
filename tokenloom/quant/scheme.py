"""Which quantization a user asked for: ``--quantization int8 | int4[-gN] | gguf``."""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.quant.int8.formats import INT4_GROUP_SIZES

CHOICES = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128", "gguf")


@dataclass(frozen=True)
class WeightFormat:
    """One layer's quantized format: bits and group size (None: one int8 scale per row)."""

    bits: int
    group_size: int | None

    @property
    def name(self) -> str:
        if self.bits == 8:
            return "int8" if self.group_size is None else f"int8-g{self.group_size}"
        return f"int4-g{self.group_size}"

    @staticmethod
    def parse(name: str) -> WeightFormat:
        """'int8', 'int8-g32', 'int4' (group 32), 'int4-g64', ... -> WeightFormat."""
        base, _, group = name.partition("-g")
        if base not in ("int8", "int4") or (group and not group.isdigit()):
            raise ValueError(f"unknown weight format {name!r}")
        size = int(group) if group else (32 if base == "int4" else None)
        if base == "int4" and size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {size}")
        if size is not None and size % 32:
            raise ValueError(f"group size must be a multiple of 32, got {size}")
        return WeightFormat(8 if base == "int8" else 4, size)


def parse_quantization(value: str | None) -> str | None:
    """Validate a ``--quantization`` value; None/'none' means float weights."""
    if value in (None, "", "none"):
        return None
    if value == "gguf":
        return value
    try:
        WeightFormat.parse(value)
    except ValueError:
        raise ValueError(f"quantization must be one of {', '.join(CHOICES)} (or none), got {value!r}") from None
    return value
