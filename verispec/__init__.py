"""verispec: a speculative-decoding LLM inference engine configured like vLLM."""

from verispec.llm import LLM
from verispec.outputs import CompletionOutput, Logprob, RequestOutput
from verispec.sampling_params import SamplingParams
from verispec.spec_config import SpeculativeConfig

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
