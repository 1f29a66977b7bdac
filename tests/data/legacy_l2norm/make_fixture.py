"""How this folder was made: run with the code of commit 046bb29 (before LMConfig.l2norm_convention existed)
as `PYTHONPATH=<that commit>/src python make_fixture.py OUT`, then copy config.json, model.safetensors
(from OUT/step_00000000) and expected_logits.json here. tests/test_conventions.py loads it with today's code."""
import json
import sys

import torch

from linattn import checkpoint as ck
from linattn.models import LanguageModel, LMConfig

torch.manual_seed(0)
cfg = LMConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, mixer=["deltanet", "gated-deltanet", "kda"],
               ffn="none", max_seq_len=64)
model = LanguageModel(cfg).double()
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            p.mul_(1e-3)   # key and query norms ~1e-3, where x/max(|x|,eps) and x/sqrt(|x|^2+eps) differ
model = model.float()
out = sys.argv[1]
ck.save_checkpoint(out, 0, model, model_config=ck.model_config_to_dict(cfg), keep_last=None)
ids = torch.arange(24).remainder(32).view(1, 24)
with torch.no_grad():
    logits = model(ids).logits
with open(f"{out}/expected_logits.json", "w") as f:
    json.dump({"ids": ids.tolist(), "logits": logits.double().tolist()}, f)
