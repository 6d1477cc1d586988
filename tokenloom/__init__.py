"""tokenloom: a fast, hackable LLM inference engine."""

from tokenloom.outputs import CompletionOutput, RequestOutput
from tokenloom.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so that
    # `import tokenloom` stays cheap for the CLI's --help.
    if name == "LLM":
        from tokenloom.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
