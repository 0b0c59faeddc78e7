"""The package's dependency rules (docs/architecture.md): no import cycle anywhere, lower layers
never import higher ones, and an in-process run never imports Flower."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fedbed

PACKAGE_ROOT = Path(fedbed.__file__).resolve().parent

LAYERS = [
    {"fedbed.seeding", "fedbed.jsonlog", "fedbed.run_directory"},
    {"fedbed.data", "fedbed.models"},
    {"fedbed.federation"},
    {"fedbed.algorithms"},
    {"fedbed.config", "fedbed.build", "fedbed.experiment", "fedbed.provenance", "fedbed.run_result", "fedbed.tracking"},
    {"fedbed.backends", "fedbed.flower"},
    {"fedbed.sweep", "fedbed.results", "fedbed.reporting", "fedbed.plots"},
    {"fedbed.cli", "fedbed.__main__", "fedbed.doc_tables"},
]
"""docs/architecture.md's layers, top to bottom: a module may import its own layer and those above."""


def module_name(path: Path) -> str:
    parts = ("fedbed",) + path.relative_to(PACKAGE_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the FedBed modules it imports anywhere in its file (also inside functions)."""
    modules = {module_name(path): path for path in PACKAGE_ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                base = node.module if node.level == 0 else ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [node.module])
                imported |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[name] = {other for other in imported if other in modules and other != name}
    return graph


def layer_of(module: str) -> int:
    for index, layer in enumerate(LAYERS):
        if any(module == top or module.startswith(top + ".") for top in layer):
            return index
    raise AssertionError(f"{module} is in no layer of docs/architecture.md; add it there and to LAYERS")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lower_layers_never_import_higher_ones():
    upward = sorted(f"{module} -> {other}" for module, imported in import_graph().items() for other in imported
                    if layer_of(other) > layer_of(module))
    assert upward == []


def test_an_in_process_run_does_not_import_flower():
    code = ("import sys; from fedbed.cli import main; from fedbed.backends import run_on_backend; "
            "from fedbed.experiment import run_experiment; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'flwr' or m.startswith('fedbed.flower')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def count_validations(monkeypatch) -> list:
    """Every later call of :func:`fedbed.config.validate`, by any FedBed module (each reference
    to it replaced by a counting wrapper): the settings of each call, in order."""
    import fedbed.config

    original, calls = fedbed.config.validate, []

    def counting(config):
        calls.append(config)
        return original(config)

    for name, module in list(sys.modules.items()):
        if (name == "fedbed" or name.startswith("fedbed.")) and getattr(module, "validate", None) is original:
            monkeypatch.setattr(module, "validate", counting)
    return calls


def test_a_run_validates_its_settings_once(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fedbed.cli import app
    from fedbed.experiment import ExperimentConfig, run_experiment

    calls = count_validations(monkeypatch)
    tiny = ["--rounds", "1", "--local-steps", "1", "--model", "lenet", "--no-progress"]
    result = CliRunner().invoke(app, ["run", *tiny, "--run-dir", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert len(calls) == 1
    result = CliRunner().invoke(app, ["run", *tiny, "--run-dir", str(tmp_path / "cli"), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert len(calls) == 2
    run_experiment(ExperimentConfig(rounds=1, local_steps=1, model="lenet", run_dir=tmp_path / "api"), progress=False,
                   echo=lambda *_: None)
    assert len(calls) == 3


def test_settings_validated_where_a_run_was_submitted_are_not_validated_again_by_its_apps(tmp_path, monkeypatch):
    import tomllib

    import pytest
    from flwr.common.config import flatten_dict, parse_config_args

    from fedbed.config import (
        ExperimentConfig,
        ValidatedConfig,
        validate,
        validated_settings,
    )
    from fedbed.flower.apps import config_json_from_run_config, digest_of_run_config
    from fedbed.flower.deployment import write_app

    validated = validate(ExperimentConfig(rounds=1, local_steps=1, model="lenet", hp={"client_lr": 0.05},
                                          run_dir=tmp_path / "run")).with_absolute_paths()
    with pytest.raises(TypeError, match="made by fedbed.config.validate only"):
        ValidatedConfig(validated.config, validated.dataset, validated.algorithm, validated.hparams, None)
    write_app(tmp_path / "app", validated)
    run_config = flatten_dict(tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    calls = count_validations(monkeypatch)

    def received(run_config) -> ValidatedConfig:  # as a deployed ServerApp or ClientApp parses it
        return validated_settings(ExperimentConfig.model_validate_json(config_json_from_run_config(run_config)),
                                  digest_of_run_config(run_config))

    deployed = received(run_config)
    simulated = validated_settings(ExperimentConfig.model_validate_json(validated.config.model_dump_json()),
                                   validated.digest)  # cached_run's key, as a client process holds it
    assert calls == []
    for other in (deployed, simulated):
        assert (other.config, other.hparams, other.algorithm.name, other.dataset.name, other.evaluation_protocol) == (
            validated.config, validated.hparams, validated.algorithm.name, validated.dataset.name,
            validated.evaluation_protocol)
    # A setting overridden after validation (flwr run --run-config), or settings without the marker: validated there.
    assert received({**run_config, **parse_config_args(["fedbed.rounds=3"])}).config.rounds == 3
    assert len(calls) == 1
    received({key: value for key, value in run_config.items() if key != "fedbed-validated"})
    assert len(calls) == 2


RUN_MODULES = ("fedbed.federation.transport", "fedbed.federation.engine", "fedbed.federation.run_log",
               "fedbed.federation.checkpoints", "fedbed.build", "fedbed.experiment", "fedbed.backends", "fedbed.flower",
               "fedbed.sweep")
"""The transports, the engine and its run loop (the run's log, its checkpoints) and the modules
that build or run a run: the settings (``fedbed.config``) never import them."""


def test_the_settings_import_no_engine_transport_or_run_module():
    graph = import_graph()
    imported = set(graph["fedbed.config"])
    assert sorted(m for m in imported if any(m == r or m.startswith(r + ".") for r in RUN_MODULES)) == []
    reached, frontier = set(), ["fedbed.config"]
    while frontier:
        for other in graph[frontier.pop()] - reached:
            reached.add(other)
            frontier.append(other)
    # Nor through the modules they import (config reads the methods' registry and options).
    indirect = RUN_MODULES
    assert sorted(m for m in reached if any(m == r or m.startswith(r + ".") for r in indirect)) == []


METHODS_PACKAGE = PACKAGE_ROOT / "algorithms"
SEAM_PACKAGES = ("base", "options")
METHOD_FILE_LINES = 310
"""A method file's length: about 300 lines at most (docs/architecture.md, "Adding a method")."""
METHOD_CODE_LINES = 200
"""A method file's lines of code, its docstrings, comments and blank lines left out."""
LONGER_METHOD_FILES = {"fedadg.py": 405, "mcgdm.py": 405, "fedgala.py": 365}
"""Method files over :data:`METHOD_FILE_LINES` because their docstrings carry the paper's readings
and where the authors' code differs (their code is within :data:`METHOD_CODE_LINES`), each held at
its length: none may grow."""


def code_lines(path: Path) -> int:
    source = path.read_text()
    documentation = {line for node in ast.walk(ast.parse(source))
                     if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                     for line in range(node.lineno, node.end_lineno + 1)}
    return sum(1 for number, line in enumerate(source.splitlines(), 1)
               if number not in documentation and line.strip() and not line.strip().startswith("#"))


def method_files() -> list[Path]:
    return sorted(path for path in METHODS_PACKAGE.glob("*.py") if path.name != "__init__.py")


def test_no_method_file_defines_fit():
    """A method writes hooks, never a client's whole round (``LocalTrainer.fit``)."""
    offenders = [f"{path.name}:{node.name}" for path in method_files() for cls in ast.walk(ast.parse(path.read_text()))
                 if isinstance(cls, ast.ClassDef) for node in cls.body
                 if isinstance(node, ast.FunctionDef) and node.name == "fit"]
    assert not offenders, f"method files that override fit (write hooks of LocalTrainer instead): {offenders}"


def test_method_files_stay_small():
    lengths = {path.name: len(path.read_text().splitlines()) for path in method_files()}
    too_long = {name: length for name, length in lengths.items()
                if length > LONGER_METHOD_FILES.get(name, METHOD_FILE_LINES)}
    assert not too_long, f"method files over {METHOD_FILE_LINES} lines (move shared code to algorithms/base): {too_long}"
    assert all(lengths.get(name, 0) > METHOD_FILE_LINES for name in LONGER_METHOD_FILES), \
        "a file of LONGER_METHOD_FILES is now short enough: remove it from the list"
    too_much_code = {path.name: code_lines(path) for path in method_files() if code_lines(path) > METHOD_CODE_LINES}
    assert not too_much_code, f"method files over {METHOD_CODE_LINES} lines of code: {too_much_code}"


def test_the_seams_never_import_a_method():
    graph = import_graph()
    methods = {f"fedbed.algorithms.{path.stem}" for path in method_files()}
    seams = [name for name in graph if any(name.startswith(f"fedbed.algorithms.{package}") for package in SEAM_PACKAGES)]
    assert seams
    offenders = {name: sorted(graph[name] & methods) for name in seams if graph[name] & methods}
    assert not offenders, f"seams that import a method: {offenders}"


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for other in graph[todo.pop()] - seen:
            seen.add(other)
            todo.append(other)
    return seen


def test_the_round_loop_never_imports_a_method():
    imported = reachable(import_graph(), "fedbed.federation.engine")
    assert not {name for name in imported if name.startswith("fedbed.algorithms")}


def test_the_architecture_diagram_names_every_layer_in_order():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    diagram = doc.split("```mermaid", 1)[1].split("```", 1)[0]
    nodes = [line.strip() for line in diagram.splitlines() if '["' in line]
    assert len(nodes) == len(LAYERS)
    for node, layer in zip(nodes, LAYERS):
        named = {module.removeprefix("fedbed.") for module in layer}
        assert any(name in node for name in named), f"diagram node {node!r} names none of {sorted(layer)}"


DEVICE_NAMES = {"cpu", "cuda", "mps"}
"""Device names that only ``fedbed.federation.devices`` may write."""


def test_no_module_but_the_device_resolver_names_a_device():
    """Everything else receives a ``torch.device`` (``resolve_device``, ``HOST``): no string
    naming a device (``"cpu"``, ``"cuda:0"``), no ``.cpu()`` / ``.cuda()``."""
    offenders = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        if module_name(path) == "fedbed.federation.devices":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.partition(":")[0] in DEVICE_NAMES:
                offenders.append(f"{module_name(path)}:{node.lineno} {node.value!r}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in {"cpu", "cuda"}:
                offenders.append(f"{module_name(path)}:{node.lineno} .{node.func.attr}()")
    assert not offenders, f"device names outside fedbed.federation.devices: {offenders}"


def test_the_suites_workers_share_the_cores_in_every_thread_pool():
    """tests/conftest.py: torch's and every BLAS/OpenMP pool a worker loaded (numpy's and scipy's
    OpenBLAS, scikit-learn's OpenMP) use the worker's share of the cores, whatever thread counts
    the shell set and with or without xdist; an OpenBLAS pool of all cores in each worker made
    numpy-heavy tests stall several-fold."""
    import scipy.linalg  # noqa: F401 (loads scipy's OpenBLAS)
    import sklearn  # noqa: F401
    import torch
    from threadpoolctl import threadpool_info

    from tests.conftest import TORCH_THREADS

    pools = {pool["filepath"]: pool["num_threads"] for pool in threadpool_info()}
    assert pools and all(threads <= TORCH_THREADS for threads in pools.values()), pools
    assert torch.get_num_threads() <= TORCH_THREADS
