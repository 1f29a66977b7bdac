"""The public API's docstrings: Google-style sections that the API reference renders, and examples that run.

Every object in DOCUMENTED has an "Args:" section naming each of its parameters (a class: its constructor's;
a NamedTuple or a dataclass: an "Attributes:" section naming its fields) and a "Returns:" section (functions
that return a value); every object with an "Examples:" section has its `>>>` lines run by doctest
here, so an example that no longer matches the code fails. The operators must have an example. When griffe
(the parser mkdocstrings uses) is installed, every docstring of the package must parse without a warning.
"""
from __future__ import annotations

import ast
import dataclasses
import doctest
import importlib
import inspect
import logging
import re
import textwrap
from pathlib import Path

import pytest

# The public operators: each has Args, Returns and a runnable example.
OPERATORS = [
    "linattn.linear_attention", "linattn.explain", "linattn.softmax_attention", "linattn.delta_rule", "linattn.comba",
    "linattn.delta_product", "linattn.rwkv7", "linattn.mesa_net", "linattn.ttt", "linattn.titans",
    "linattn.forgetting_attention", "linattn.forgetting_attention_step", "linattn.deltaformer",
    "linattn.deltaformer_step", "linattn.path_attention", "linattn.path_attention_step",
]
# Further public objects whose docstrings have Google-style sections (added as they are written).
DOCUMENTED = OPERATORS + [
    "linattn.LinearAttentionState", "linattn.MesaState", "linattn.TTTState", "linattn.ForgettingAttentionState",
    "linattn.DeltaFormerState", "linattn.PaTHState", "linattn.FeatureMap", "linattn.FeatureMap.build",
    "linattn.FeatureMap.kernel", "linattn.FeatureMap.feature_dim", "linattn.FeatureMap.phi",
    "linattn.FeatureMap.psi", "linattn.FAVORPlus", "linattn.register_feature_map", "linattn.feature_map_names",
    "linattn.get_feature_map", "linattn.chunk_size_used", "linattn.mixers",
    "linattn.models.registry.register_mixer", "linattn.audit.check_causality", "linattn.audit.CausalityReport",
    "linattn.set_checks", "linattn.get_checks", "linattn.prepare_delta", "linattn.prepare_linear_attention",
    "linattn.FAVORPlus.phi", "linattn.FAVORPlus.build", "linattn.FAVORPlus.feature_dim",
    "linattn.FAVORPlus.forward", "linattn.UsageError", "linattn.ops.registry.register_op",
    "linattn.ops.registry.unregister_op", "linattn.ops.registry.op_names", "linattn.ops.registry.op_spec",
    "linattn.ops.registry.reference_of", "linattn.ops.registry.chunk_size_ops",
    # layers (constructor arguments)
    "linattn.layers.AttentionBase", "linattn.layers.AttentionBase.forward", "linattn.layers.SoftmaxAttention",
    "linattn.layers.FoX", "linattn.layers.DeltaFormer", "linattn.layers.Mamba2Block", "linattn.layers.MesaNet",
    "linattn.layers.TTT", "linattn.layers.Titans", "linattn.layers.GatedDeltaNet", "linattn.layers.EFLA",
    "linattn.layers.RWKV7", "linattn.layers.DeltaNet", "linattn.layers.KDA", "linattn.layers.Comba",
    "linattn.layers.DeltaProduct", "linattn.layers.PaTH", "linattn.layers.LinearAttention", "linattn.layers.Cache",
    "linattn.layers.Cache.crop", "linattn.layers.Cache.snapshot", "linattn.layers.Cache.restore",
    "linattn.layers.Cache.reorder", "linattn.layers.Cache.history_nbytes", "linattn.layers.KVCache",
    "linattn.layers.tensor_nbytes", "linattn.layers.ShortConv", "linattn.layers.RotaryEmbedding",
    "linattn.layers.RMSNorm", "linattn.layers.GatedRMSNorm", "linattn.layers.SwiGLU", "linattn.layers.l2_normalize",
    "linattn.layers.check_cu_seqlens", "linattn.layers.packed_positions", "linattn.layers.ShortConv.forward",
    "linattn.layers.RotaryEmbedding.apply", "linattn.layers.Mamba2Block.forward", "linattn.layers.RWKV7.forward",
    "linattn.layers.DeltaNet.beta", "linattn.layers.DeltaNet.log_gate", "linattn.layers.GatedDeltaNet.log_gate",
    "linattn.layers.AttentionBase.resolve_scale", "linattn.layers.KDA.log_gate", "linattn.layers.DeltaProduct.beta",
    "linattn.layers.DeltaProduct.log_gate", "linattn.layers.FoX.log_gate", "linattn.layers.DeltaFormer.beta",
    "linattn.layers.TTT.learning_rate", "linattn.layers.RMSNorm.forward", "linattn.layers.GatedRMSNorm.forward",
    "linattn.layers.SwiGLU.forward", "linattn.layers.RotaryEmbedding.forward", "linattn.layers.KVCache.append",
    "linattn.layers.KVCache.truncate", "linattn.layers.KVCache.index_select", "linattn.layers.Cache.layer",
    "linattn.layers.RotaryEmbedding.cos_sin", "linattn.layers.PaTH.householder", "linattn.layers.RWKV7.link_layers",
    # models
    "linattn.LMConfig", "linattn.LanguageModel", "linattn.LanguageModel.forward", "linattn.LanguageModel.generate",
    "linattn.LMConfig.from_dict", "linattn.LMConfig.to_dict", "linattn.LMConfig.to_json",
    "linattn.LMConfig.from_json", "linattn.LMConfig.replace", "linattn.LanguageModel.new_cache",
    "linattn.LanguageModel.num_parameters", "linattn.LanguageModel.stream", "linattn.LMConfig.ela_gpt",
    "linattn.LMConfig.upgrade_architecture", "linattn.models.register_family", "linattn.models.families",
    "linattn.models.get_family", "linattn.models.build_model", "linattn.models.sample_next",
    "linattn.models.LMOutput", "linattn.models.build_mixer", "linattn.models.unregister_mixer",
    "linattn.models.mixer_spec", "linattn.models.registry.mixer_config_kwargs", "linattn.models.registry.MixerSpec",
    "linattn.checkpoint.save_checkpoint", "linattn.checkpoint.load_checkpoint", "linattn.checkpoint.Checkpoint",
    "linattn.quantize", "linattn.quant.QuantizedLinear", "linattn.quant.quantization_summary",
    "linattn.quant.quantized_modules", "linattn.quant.save_quantized", "linattn.quant.load_quantized",
    "linattn.quant.QuantizedLinear.from_linear", "linattn.quant.QuantizedLinear.from_weight",
    "linattn.quant.QuantizedLinear.dequantize",
    # transformers integration (needs the hf extra)
    "linattn.hf.LinattnConfig", "linattn.hf.LinattnForCausalLM", "linattn.hf.LinattnModel",
    "linattn.hf.LinattnForSequenceClassification", "linattn.hf.export_hf", "linattn.hf.import_hf",
    "linattn.hf.hf_tokenizer", "linattn.hf.kernelize.kernelize", "linattn.hf.kernelize.KernelizeReport",
    "linattn.hf.LinattnForCausalLM.from_linattn", "linattn.hf.LinattnForCausalLM.to_linattn",
    "linattn.hf.LinattnConfig.from_lm_config", "linattn.hf.LinattnConfig.lm_config",
    "linattn.hf.kernelize.gdn_chunk", "linattn.hf.kernelize.gdn_recurrent", "linattn.hf.kernelize.kda_chunk",
    "linattn.hf.kernelize.kda_recurrent", "linattn.hf.fla.import_fla", "linattn.hf.fla.supported_types",
    "linattn.hf.LinattnForCausalLM.forward", "linattn.hf.LinattnModel.forward",
    "linattn.hf.LinattnForSequenceClassification.forward",
    # training
    "linattn.training.TrainConfig", "linattn.training.train", "linattn.training.TrainResult",
    "linattn.training.evaluate", "linattn.training.EvalResult", "linattn.training.StepOutput",
    "linattn.training.Trainer", "linattn.training.Trainer.train_step", "linattn.training.Trainer.evaluate",
    "linattn.training.Trainer.state_dict", "linattn.training.Trainer.load_state_dict",
    "linattn.training.Trainer.model_state_dict", "linattn.training.TrainConfig.check_split",
    "linattn.training.training_tokens_per_second", "linattn.training.prepare_data", "linattn.training.TrainData",
    "linattn.training.rank_batch", "linattn.training.lr_at", "linattn.training.make_optimizer",
    "linattn.training.read_metrics", "linattn.training.Dist", "linattn.training.Dist.from_env",
    # benchmarks
    "linattn.bench.add_arguments", "linattn.bench.main", "linattn.bench.load", "linattn.bench.run_benchmark",
    "linattn.bench.command_line", "linattn.bench.ops.add_arguments", "linattn.bench.ops.run",
    "linattn.bench.decode.add_arguments", "linattn.bench.decode.run", "linattn.bench.train.add_arguments",
    "linattn.bench.train.run", "linattn.bench.hf.add_arguments", "linattn.bench.hf.run",
    "linattn.bench.gpu.add_arguments", "linattn.bench.gpu.run", "linattn.bench.data.add_arguments",
    "linattn.bench.data.run", "linattn.bench.tlinformer.add_arguments", "linattn.bench.tlinformer.run",
    "linattn.bench.vision.add_arguments", "linattn.bench.vision.run",
    "linattn.bench.quant.add_arguments", "linattn.bench.quant.run",
]
# modules whose docstrings the API reference renders (docs/api/*.md)
RENDERED_MODULES = ["linattn", "linattn.training", "linattn.hf", "linattn.layers", "linattn.models", "linattn.audit",
                    "linattn.errors"]
SECTION = re.compile(r"^(\s*)(Args|Arguments|Returns|Yields|Raises|Examples|Example|Attributes|Note|Notes):\s*$")


def resolve(dotted: str):
    if dotted.startswith("linattn.hf"):
        pytest.importorskip("transformers")      # the hf extra
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:     # a method: module.Class.method
        if e.name != module:
            raise
        return getattr(resolve(module), name)


def sections(doc: str) -> dict:
    """{section name: its lines, dedented} of a cleaned docstring; the text before the first section is ''."""
    out, current, indent = {"": []}, "", 0
    for line in doc.splitlines():
        m = SECTION.match(line)
        if m and len(m.group(1)) == 0:
            current, indent = m.group(2), None
            out[current] = []
            continue
        if current and line.strip() and indent is None:
            indent = len(line) - len(line.lstrip())
        out[current].append(line[indent:] if current and indent else line)
    return out


def parameters(obj, variadic: bool = False) -> list:
    """The names Args must document; variadic=True: also those it may document (*args, **kwargs)."""
    if hasattr(obj, "_fields"):       # a NamedTuple: its fields, documented as Attributes
        return []
    target = obj.__init__ if inspect.isclass(obj) else obj
    params = inspect.signature(target).parameters.values()
    star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [star.get(p.kind, "") + p.name for p in params if p.name != "self"
            and (variadic or p.kind not in star)]


def documented_args(lines: list) -> list:
    # an entry starts at the section's own indentation: "name: text" or "name (type): text"
    return [m.group(1) for line in lines if (m := re.match(r"^(\*{0,2}\w+)(\s*\([^)]*\))?:", line))]


def returns_value(fn) -> bool:
    """Whether a function returns something: not annotated `-> None`, and a `return <value>` or `yield` in its body."""
    if inspect.signature(fn).return_annotation in (None, "None"):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError):          # no source (a builtin): assume it does
        return True
    body = tree.body[0]
    nodes, found = list(ast.iter_child_nodes(body)), False
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue                      # a nested function's returns are its own
        found |= isinstance(node, (ast.Yield, ast.YieldFrom))
        found |= isinstance(node, ast.Return) and node.value is not None
        nodes.extend(ast.iter_child_nodes(node))
    return found


def section_problems(obj, name: str, example_required: bool = False) -> list:
    """What the docstring of `obj` lacks (empty: nothing)."""
    doc = inspect.getdoc(obj)
    if not doc:
        return [f"{name} has no docstring"]
    problems, secs, params = [], sections(doc), parameters(obj)
    if params:
        # a dataclass may document its fields (its constructor's parameters) as Attributes
        fields = "Attributes" if dataclasses.is_dataclass(obj) and "Args" not in secs else "Args"
        if fields not in secs:
            return [f"{name}: no Args section"]
        args = documented_args(secs[fields])
        missing = [p for p in params if p not in args]
        unknown = [a for a in args if a not in parameters(obj, variadic=True)]
        if missing:
            problems.append(f"{name}: Args does not document {missing}")
        if unknown:
            problems.append(f"{name}: Args documents {unknown}, which the signature lacks")
    if hasattr(obj, "_fields"):
        attrs = documented_args(secs.get("Attributes", []))
        if attrs != list(obj._fields):
            problems.append(f"{name}: Attributes documents {attrs}, the fields are {obj._fields}")
    if not inspect.isclass(obj) and returns_value(obj) and "Returns" not in secs and "Yields" not in secs:
        problems.append(f"{name}: no Returns section")
    if example_required and "Examples" not in secs:
        problems.append(f"{name}: no Examples section")
    return problems


@pytest.mark.parametrize("dotted", DOCUMENTED)
def test_sections(dotted):
    assert not section_problems(resolve(dotted), dotted, example_required=dotted in OPERATORS)


def test_section_check_finds_what_is_missing():
    # the check above is not a no-op: an undocumented argument, an unknown one and a missing Returns are found;
    # a function that returns nothing needs no Returns
    def f(a, b, *, c=None):
        """Summary.

        Args:
            a: documented.
            d: not a parameter.
        """
        return a

    problems = section_problems(f, "f", example_required=True)
    assert any("does not document ['b', 'c']" in p for p in problems)
    assert any("['d']" in p for p in problems)
    assert any("no Returns" in p for p in problems) and any("no Examples" in p for p in problems)

    def g(a):
        """Summary.

        Args:
            a: documented.
        """
        def inner():
            return 1
        print(a, inner)

    assert section_problems(g, "g") == []


def run_examples(dotted: str, text: str):
    test = doctest.DocTestParser().get_doctest(text, {}, dotted, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    runner.run(test, out=report.append)
    return runner.summarize(verbose=False), "".join(report)


def examples(dotted: str) -> str:
    return "\n".join(sections(inspect.getdoc(resolve(dotted)) or "").get("Examples", []))


def has_examples(dotted: str) -> bool:
    try:
        return dotted in OPERATORS or bool(examples(dotted).strip())
    except pytest.skip.Exception:      # without the hf extra: collected, then skipped when it runs
        return True


@pytest.mark.parametrize("dotted", [d for d in DOCUMENTED if has_examples(d)])
def test_examples_run(dotted):
    text = examples(dotted)
    result, report = run_examples(dotted, text)
    assert result.attempted > 0, f"{dotted}: the Examples section has no >>> line"
    assert result.failed == 0, f"{dotted}: the example fails:\n{report}"


def test_a_wrong_example_fails():
    # the runner above is not a no-op: a false expected output is reported as a failure
    result, report = run_examples("wrong", ">>> 1 + 1\n3\n")
    assert result.attempted == 1 and result.failed == 1 and "Expected" in report


def test_griffe_parses_without_warnings():
    # every docstring of the package, parsed as the site's mkdocstrings options do (mkdocs.yml: google style,
    # warn_unknown_params on, warn_missing_types off): a warning there fails `mkdocs build --strict`
    griffe = pytest.importorskip("griffe")
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    admonitions = {}    # path -> titles of the "Word:" groups griffe turned into admonition boxes

    def parse_all(obj, seen):
        if obj.is_alias or obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            parsed = obj.docstring.parse("google", warn_unknown_params=True, warn_missing_types=False)
            admonitions[obj.path] = [s.title for s in parsed if s.kind.value == "admonition"]
        for member in obj.members.values():
            parse_all(member, seen)

    logger = logging.getLogger("griffe")
    handler = Collect()
    logger.addHandler(handler)
    try:
        src = Path(__file__).resolve().parents[2] / "src"
        package = griffe.load("linattn", search_paths=[str(src)], docstring_parser="google",
                              allow_inspection=False, resolve_aliases=False)
        seen = set()
        parse_all(package, seen)
        for dotted in DOCUMENTED:                    # the documented objects were all reached
            try:
                obj = resolve(dotted)
            except pytest.skip.Exception:            # linattn.hf without the hf extra
                continue
            path = f"{obj.__module__}.{obj.__qualname__}"
            assert path in seen, dotted
            # a "Models:" / "FFN:" group line becomes an admonition box whose lines run together on the site
            assert set(admonitions.get(path, [])) <= {"Note", "Warning"}, (path, admonitions[path])
        for module in RENDERED_MODULES:
            assert set(admonitions.get(module, [])) <= {"Note", "Warning"}, (module, admonitions[module])
    finally:
        logger.removeHandler(handler)
    assert not messages, "\n".join(messages)
