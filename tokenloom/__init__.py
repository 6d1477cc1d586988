"""tokenloom: a fast, hackable LLM inference engine."""

from tokenloom.sampling_params import SamplingParams
from tokenloom.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so that
    # `import tokenloom` stays cheap for the CLI's --help.
    if name == "LLM":
        from tokenloom.llm import LLM
        return LLM
    raise AttributeError(name)
