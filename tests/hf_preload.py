"""Loaded by the test fork server (``harness.PRELOAD``): the ``transformers`` classes that ranks
and forked commands load (about 2 s of CPU in each, otherwise). Without transformers, nothing."""

try:
    import transformers
except ImportError:
    transformers = None

for _name in ("AutoTokenizer", "PreTrainedTokenizerFast", "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM"):
    getattr(transformers, _name, None)  # transformers imports each class's module on first access
