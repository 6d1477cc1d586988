"""StepRecords as terminal text: compact (two lines a token) or full (a candidate table).

Every line fits `width` columns (80 by default); ANSI colors only when asked (on a TTY).
"""

from __future__ import annotations

from tokenloom.explain.records import StepRecord

Segment = tuple[str, str]  # (text, style name); styles below, "" for plain

_STYLES = {"dim": "2", "bold": "1", "high": "1;32", "mid": "1;33", "low": "1;31", "cut": "2;9"}

LEGEND = (
    "p: probability in the distribution the token was drawn from (after penalties,\n"
    "temperature, top-k/top-p/min-p); model: the model's own; [bracketed]: cut.\n"
)


def token_label(text: str, limit: int = 14) -> str:
    """A token's text quoted, with control characters escaped and long ones shortened."""
    shown = repr(text)[1:-1] if text else ""
    if len(shown) > limit - 2:
        shown = shown[: limit - 3] + "…"
    return f"'{shown}'"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _prob_style(p: float) -> str:
    return "high" if p >= 0.5 else "mid" if p >= 0.1 else "low"


def _line(segments: list[Segment], width: int, color: bool) -> str:
    """Join segments, clipped to `width` visible columns, styled if `color`."""
    out, used = [], 0
    for text, style in segments:
        text = text[: max(0, width - used)]
        used += len(text)
        out.append(f"\x1b[{_STYLES[style]}m{text}\x1b[0m" if color and style and text else text)
    return "".join(out).rstrip()


def _cuts(record: StepRecord) -> str:
    parts = [f"{reason.replace('_', '-')} {n:,}" for reason, n in record.num_cut.items()]
    if record.num_penalized:
        by = ", ".join(f"{name.replace('_', '-')} {n:,}" for name, n in record.num_moved.items())
        parts.append(f"penalized {record.num_penalized:,}" + (f" ({by})" if by else ""))
    return " · ".join(parts)


def _header(record: StepRecord) -> list[Segment]:
    return [
        (f"{record.index:>4} ", "dim"),
        (f"{token_label(record.text, 16):<17}", _prob_style(record.prob)),
        (f" p {record.prob:.2f}  model {record.model_prob:.2f}", ""),
        (f"  kept {record.num_kept:,}" if not record.greedy else "  greedy", "dim"),
        (f"  KV {record.kv_tokens} tok {human_bytes(record.kv_bytes)}", "dim"),
    ]


def render_compact(record: StepRecord, width: int = 80, color: bool = False, alternatives: int = 5) -> str:
    """Two lines (three if the cuts do not fit): the token, then its top alternatives and the cuts."""
    alts: list[Segment] = [("      alt ", "dim")]
    for c in [c for c in record.candidates if c.token_id != record.token_id][:alternatives]:
        label = f"{token_label(c.text, 12)} {c.adjusted_prob:.2f}".replace(" 0.", " .")
        alts.append((f"[{label}] " if c.cut_by else f"{label} ", "cut" if c.cut_by else ""))
    lines = [_line(_header(record), width, color), _line(alts, width, color)]
    cuts = _cuts(record)
    if cuts:
        if sum(len(t) for t, _ in alts) + len(cuts) + 3 <= width:
            lines[1] = _line(alts + [("· " + cuts, "dim")], width, color)
        else:
            lines.append(_line([("      cut " + cuts, "dim")], width, color))
    return "\n".join(lines)


def render_full(record: StepRecord, width: int = 80, color: bool = False) -> str:
    """The header, a table of every listed candidate, and the step's cuts and cost."""
    lines = [
        _line(_header(record), width, color),
        _line([("       token            logit   model  adjusted       p  penalty  cut by", "dim")], width, color),
    ]
    for c in record.candidates:
        mark = ">" if c.token_id == record.token_id else " "
        penalty = f"{c.penalty:+.2f}" if c.penalty else ""
        row = (
            f"     {mark} {token_label(c.text, 16):<16} {c.logit:6.2f}  {c.model_prob:6.3f}  {c.adjusted_prob:8.3f}"
            f"  {c.prob:6.3f}  {penalty:>7}  {c.cut_by or ''}"
        )
        style = "bold" if mark == ">" else "cut" if c.cut_by else ""
        lines.append(_line([(row, style)], width, color))
    summary = (
        f"       T {record.temperature:g} · {_cuts(record) or 'nothing cut'} · "
        f"step {record.step_time_s * 1e3:.1f} ms"
        f" · {record.kv_blocks_used} KV blocks in use"
    )
    lines.append(_line([(summary, "dim")], width, color))
    return "\n".join(lines)
