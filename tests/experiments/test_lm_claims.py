"""Language-model experiments on the seed papers' claims: `lm --seeds`, `ela-ablations`, `efla-variants`
and `tlinformer` (tiny budgets on a small text file end to end, resume, the spread criterion, the
models each experiment builds). Never reads /work/shared."""
import json
import math

import pytest

from linattn import cli
from linattn.experiments import efla_variants, ela_ablations, lm, tlinformer
from linattn.models import LanguageModel, LMConfig
from linattn.models.tlinformer import TLinFormerConfig, TLinFormerLM


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    text = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(600))
    (root / "train.txt").write_text(text)
    (root / "valid.txt").write_text(text[:4000])
    return root


def _run(name, corpus, out, *extra):
    return cli.main(["experiment", name, "--budget", "tiny", "--data", str(corpus), "--out", str(out),
                     "--no-progress", "--threads", "1", *extra])


def _report(out):
    return json.loads((out / "results.json").read_text())


# ---------------------------------------------------------------- lm --seeds

def test_lm_seeds_give_runs_per_seed_a_mean_std_table_and_paired_differences(tmp_path, corpus):
    out = tmp_path / "lm"
    assert _run("lm", corpus, out, "--models", "efla,deltanet", "--steps", "2", "--seeds", "2") == 0
    rep = _report(out)
    assert sorted(r["run_id"] for r in rep["runs"]) == ["deltanet--s0", "deltanet--s1", "efla--s0", "efla--s1"]
    assert [r["seed"] for r in rep["runs"]] == [0, 0, 1, 1]                  # seed by seed
    efla = rep["summary"]["models"]["efla"]
    assert len(efla["val_ppl_per_seed"]) == 2 and efla["val_ppl_std"] is not None
    assert math.isclose(efla["val_ppl"], sum(efla["val_ppl_per_seed"]) / 2)
    (comp,) = rep["summary"]["comparisons"]                                   # efla vs deltanet, declared by lm
    assert (comp["a"], comp["b"], comp["n"], comp["seeds"]) == ("efla", "deltanet", 2, [0, 1])
    md = (out / "results.md").read_text()
    assert "±" in md and "val ppl per seed (s0 / s1)" in md and "EFLA vs DeltaNet" in md
    assert "the spread" in md and (out / "lm.png").is_file()

    # a seed's runs do not depend on the other seeds: --seeds 1 reproduces seed 0 exactly
    one = tmp_path / "one"
    assert _run("lm", corpus, one, "--models", "efla", "--steps", "2") == 0
    (r,) = _report(one)["runs"]
    assert r["run_id"] == "efla--s0" and r["val_ppl"] == efla["val_ppl_per_seed"][0]


def test_a_resume_may_add_seeds_and_models_and_report_only_trains_nothing(tmp_path, corpus):
    out = tmp_path / "lm"
    assert _run("lm", corpus, out, "--models", "efla", "--steps", "2") == 0
    first = (out / "runs" / "efla--s0.json").stat().st_mtime_ns
    assert _run("lm", corpus, out, "--models", "efla,deltanet", "--steps", "2", "--seeds", "2", "--report-only") == 0
    rep = _report(out)
    assert [r["run_id"] for r in rep["runs"]] == ["efla--s0"]
    assert "Incomplete: 1 of 4" in (out / "results.md").read_text()
    assert _run("lm", corpus, out, "--models", "efla,deltanet", "--steps", "2", "--seeds", "2", "--resume") == 0
    assert len(_report(out)["runs"]) == 4 and (out / "runs" / "efla--s0.json").stat().st_mtime_ns == first
    assert _run("lm", corpus, out, "--models", "efla", "--steps", "3", "--resume") == 2   # another protocol


def _rec(model, seed, ppl):
    return {"model": model, "seed": seed, "val_ppl": ppl}


def test_the_spread_criterion_on_hand_made_numbers():
    runs = [_rec("a", 0, 100.0), _rec("a", 1, 102.0), _rec("a", 2, 101.0),
            _rec("b", 0, 110.0), _rec("b", 1, 111.0), _rec("b", 2, 112.0),     # a lower by 10, 9, 11
            _rec("c", 0, 95.0), _rec("c", 1, 112.0), _rec("c", 2, 101.0),      # d = a - c: +5, -10, 0
            _rec("d", 0, 120.0)]                                               # one common seed only
    comps = lm.compare(lm.by_model(runs), [("a", "b"), ("a", "c"), ("a", "d"), ("a", "missing")])
    assert [(c["a"], c["b"]) for c in comps] == [("a", "b"), ("a", "c"), ("a", "d")]   # pairs that ran
    ab, ac, ad = comps
    assert ab["diffs"] == [-10.0, -9.0, -11.0] and ab["mean"] == -10.0 and ab["exceeds"] is True
    assert ab["positive"] == 0 and ab["n"] == 3                 # |-10| > 2 * 1 / sqrt(3)
    assert ac["diffs"] == [5.0, -10.0, 0.0] and ac["exceeds"] is False and ac["positive"] == 1
    assert ad["seeds"] == [0] and ad["n"] == 1 and ad["exceeds"] is None
    # exactly at the bound is within: d = 1, 3 -> mean 2, std sqrt(2), 2 * std / sqrt(2) = 2
    edge = lm.compare(lm.by_model([_rec("a", 0, 1.0), _rec("a", 1, 3.0), _rec("b", 0, 0.0), _rec("b", 1, 0.0)]),
                      [("a", "b")])[0]
    assert math.isclose(edge["mean"], 2.0) and edge["exceeds"] is False


# ---------------------------------------------------------------- ela-ablations

def test_ela_ablations_end_to_end_and_resume(tmp_path, corpus, monkeypatch, capsys):
    out = tmp_path / "ela"
    assert _run("ela-ablations", corpus, out) == 0                            # 2 seeds by default
    rep = _report(out)
    assert len(rep["runs"]) == 10 and {r["model"] for r in rep["runs"]} == set(ela_ablations.MODELS)
    assert all(r["causal"] and r["arch"] == "LMConfig" for r in rep["runs"])
    pairs = [(c["a"], c["b"]) for c in rep["summary"]["comparisons"]]
    assert pairs == [("hyperlink", "prenorm"), ("moe-eq14", "hyperlink"), ("moe-eq15", "hyperlink"),
                     ("moe-eq14", "moe-eq15"), ("lobe-causal", "hyperlink")]
    assert all(c["n"] == 2 and c["exceeds"] is not None for c in rep["summary"]["comparisons"])
    md = (out / "results.md").read_text()
    assert "Hyper-Link (base) vs pre-norm residuals" in md and "750th" in md
    assert "Validation perplexity during training (each seed: s0 / s1)" in md
    assert (out / "ela-ablations.png").is_file() and (out / "ela-ablations_tokens_per_s.png").is_file()
    first = {r["run_id"]: r["finished_at"] for r in rep["runs"]}
    capsys.readouterr()

    # --resume skips finished runs: nothing is trained again, the tables are rendered again
    def boom(*a, **k):
        raise AssertionError("a finished run was retrained")

    monkeypatch.setattr(lm, "train_run", boom)
    assert _run("ela-ablations", corpus, out, "--resume") == 0
    assert "10/10 runs already finished" in capsys.readouterr().out
    assert {r["run_id"]: r["finished_at"] for r in _report(out)["runs"]} == first
    monkeypatch.undo()

    # a deleted run file is redone, alone
    (out / "runs" / "moe-eq15--s1.json").unlink()
    calls = []
    real = lm.train_run
    monkeypatch.setattr(lm, "train_run", lambda spec, *a, **k: calls.append(spec["run_id"]) or real(spec, *a, **k))
    assert _run("ela-ablations", corpus, out, "--resume") == 0
    assert calls == ["moe-eq15--s1"]


def test_ela_ablation_models_change_one_thing():
    b = ela_ablations.BUDGETS["quick"]
    assert b.steps == 1000 > 750 and b.eval_every == 100 and (b.d_model, b.n_layers, b.seq_len, b.batch_size) == (
        128, 4, 128, 8)
    cfgs = {k: m.build(b, 2048) for k, m in ela_ablations.MODELS.items()}
    base = cfgs["hyperlink"]
    assert base == LMConfig.ela_gpt(2048, d_model=128, n_layers=4, n_heads=4, max_seq_len=512)
    assert (base.residual, base.final_norm, base.moe_bias, base.memory_lobe) == ("hyperlink", False, "none", None)
    changed = {k: {f for f in base.to_dict() if getattr(c, f) != getattr(base, f)} for k, c in cfgs.items()}
    assert changed == {"hyperlink": set(), "prenorm": {"residual", "final_norm"}, "moe-eq14": {"moe_bias"},
                       "moe-eq15": {"moe_bias"}, "lobe-causal": {"memory_lobe"}}
    assert (cfgs["moe-eq14"].moe_bias, cfgs["moe-eq15"].moe_bias, cfgs["lobe-causal"].memory_lobe) == (
        "eq14", "eq15", "causal")


# ---------------------------------------------------------------- efla-variants

def test_efla_variants_end_to_end(tmp_path, corpus):
    out = tmp_path / "efla"
    assert _run("efla-variants", corpus, out, "--seeds", "1") == 0
    rep = _report(out)
    assert [r["run_id"] for r in rep["runs"]] == ["efla--s0", "efla-adaptive--s0", "efla-loose--s0", "deltanet--s0"]
    assert [(c["a"], c["b"], c["exceeds"]) for c in rep["summary"]["comparisons"]] == [
        ("efla-adaptive", "efla", None), ("efla-loose", "efla", None), ("efla", "deltanet", None)]
    md = (out / "results.md").read_text()
    assert "one seed, spread unknown" in md and "35.13" in md and "38.09" in md
    mixers = {k: m.build(efla_variants.lm.BUDGETS["quick"], 2048).mixer for k, m in efla_variants.MODELS.items()}
    assert mixers == {"efla": "efla", "efla-adaptive": "efla-adaptive", "efla-loose": "efla-loose",
                      "deltanet": "deltanet"}
    assert efla_variants.STUDY.budgets["quick"] == lm.BUDGETS["quick"] and efla_variants.STUDY.seeds == 2


# ---------------------------------------------------------------- tlinformer

def test_tlinformer_end_to_end(tmp_path, corpus):
    out = tmp_path / "tl"
    assert _run("tlinformer", corpus, out, "--seeds", "2") == 0
    rep = _report(out)
    runs = {r["run_id"]: r for r in rep["runs"]}
    assert set(runs) == {f"{k}--s{s}" for k in tlinformer.MODELS for s in (0, 1)}
    # trained by linattn.training.train with a TLinFormerConfig (the checkpoint records the family)
    assert runs["tlinformer-half--s0"]["arch"] == "TLinFormerConfig" and runs["base--s0"]["arch"] == "LMConfig"
    saved = json.loads(next((out / "checkpoints" / "tlinformer-half--s0").glob("step_*/config.json")).read_text())
    assert saved["model"]["arch"] == "tlinformer" and saved["model"]["generation_window"] == 8
    assert saved["train"]["doc_boundaries"] is False
    assert len({r["n_params"] for r in runs.values()}) == 1 and all(r["causal"] for r in runs.values())
    md = (out / "results.md").read_text()
    for s in ("Base 32", "TLinFormer 32-16-0.5", "TLinFormer 32-32-0.5", "Parameter counts: equal", "22.5", "23.0",
              "tlinformer.md, \"TLinFormer inference\"", "TLinFormer 32-16-0.5 vs Base 32"):
        assert s in md, s


@pytest.mark.parametrize("budget", ["quick", "full"])
def test_tlinformer_has_the_parameters_of_its_baseline_at_the_real_size(budget):
    b = tlinformer.BUDGETS[budget]
    base = tlinformer.baseline(b, b.vocab_size)
    assert isinstance(base, LMConfig)
    assert (base.mixer, base.ffn, base.residual, base.final_norm, base.tie_embeddings, base.n_layers) == (
        "softmax", "swiglu", "prenorm", True, True, 8)
    ref = LanguageModel(base)
    for key in ("tlinformer-half", "tlinformer-full"):
        cfg = tlinformer.MODELS[key].build(b, b.vocab_size)
        assert isinstance(cfg, TLinFormerConfig) and (cfg.n_blocks, cfg.inner_depth, cfg.n_hidden) == (2, 4, 2)
        m = TLinFormerLM(cfg)
        assert m.num_parameters() == ref.num_parameters(), key
        assert m.layers[0].ffn.w_down.weight.shape == ref.blocks[0].ffn.w_down.weight.shape   # same SwiGLU width
    if budget == "quick":   # the paper's lengths / 4, width 128, 4 heads of 32
        assert (b.seq_len, b.d_model, b.n_heads) == (256, 128, 4) and ref.num_parameters() == 1_869_952
        windows = {k: (c.history_window, c.generation_window) for k, c in
                   ((k, tlinformer.MODELS[k].build(b, 2048)) for k in ("tlinformer-half", "tlinformer-full"))}
        assert windows == {"tlinformer-half": (64, 64), "tlinformer-full": (128, 128)}
    labels = [lm.label_of(m, b) for m in tlinformer.MODELS.values()]
    assert labels == (["Base 256", "TLinFormer 256-128-0.5", "TLinFormer 256-256-0.5"] if budget == "quick" else
                      ["Base 1K", "TLinFormer 1K-512-0.5", "TLinFormer 1K-1K-0.5"])


def test_new_experiments_advertise_their_budgets(capsys):
    for name in ("ela-ablations", "efla-variants", "tlinformer"):
        with pytest.raises(SystemExit):
            cli.main(["experiment", name, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--seeds" in text and "minutes of one thread" in text
