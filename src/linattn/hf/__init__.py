"""linattn models as Hugging Face transformers models (`pip install linattn[hf]`).

    import linattn.hf                  # registers model_type "linattn" with AutoConfig, AutoModel,
                                       # AutoModelForCausalLM and AutoModelForSequenceClassification
    hf = linattn.hf.LinattnForCausalLM.from_linattn(language_model)
    hf.save_pretrained("hf_dir")       # + configuration_linattn.py / modeling_linattn.py for trust_remote_code
    AutoModelForCausalLM.from_pretrained("hf_dir").generate(ids, max_new_tokens=20, num_beams=2)
    linattn.hf.export_hf("runs/efla", "hf_dir")    # a training checkpoint + its tokenizer -> HF folder
    linattn.hf.import_hf("hf_dir", "runs/back")    # and back (a weights-only linattn checkpoint)
    linattn.hf.import_fla("fla_dir", "runs/gla")   # a flash-linear-attention model folder -> a linattn checkpoint

`import linattn` never imports this package (nor transformers): only `import linattn.hf` does.
The `hf` extra pins `transformers>=5.23,<6`; the versions it is tested with are listed once, on the site's
transformers page (docs/transformers.md).

The modules:

    configuration_linattn.py   LinattnConfig (wraps the whole LMConfig; layer_types for the cache)
    modeling_linattn.py        LinattnForCausalLM (loss, padding, logits_to_keep, transformers' cache layers),
                               LinattnModel (the stack, no head), LinattnForSequenceClassification
    convert.py                 export_hf / import_hf, the tokenizer as a transformers tokenizer
    remote.py                  the trust_remote_code modules written by save_pretrained
    fla/                       import_fla: flash-linear-attention model folders (one module per model type)
"""
import importlib.util

if importlib.util.find_spec("transformers") is None:  # pragma: no cover - depends on the environment
    raise ImportError("linattn.hf needs the transformers library: pip install 'linattn[hf]'")

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from .configuration_linattn import LinattnConfig  # noqa: E402
from .convert import export_hf, hf_tokenizer, import_hf  # noqa: E402
from .fla import import_fla  # noqa: E402
from .kernelize import KernelizeReport, kernelize  # noqa: E402, F401
from .modeling_linattn import (  # noqa: E402
    LinattnForCausalLM,
    LinattnForSequenceClassification,
    LinattnModel,
    LinattnPreTrainedModel,
)

AutoConfig.register(LinattnConfig.model_type, LinattnConfig, exist_ok=True)
AutoModel.register(LinattnConfig, LinattnModel, exist_ok=True)
AutoModelForCausalLM.register(LinattnConfig, LinattnForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(LinattnConfig, LinattnForSequenceClassification, exist_ok=True)

__all__ = ["LinattnConfig", "LinattnForCausalLM", "LinattnForSequenceClassification", "LinattnModel",
           "LinattnPreTrainedModel", "export_hf", "import_hf", "import_fla", "hf_tokenizer"]
