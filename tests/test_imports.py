"""The package's layers import downwards only, and no modules import each
other in a circle (function-level imports included).

Layers, lowest first: ``utils`` and ``kernels`` (native code); ``models``; ``criterions`` and
``generation``; ``tasks``; ``hub`` and ``bench``.  ``compat`` and the
package's ``__init__`` (which wires the layers together) stand apart.
"""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fairseq_specdec"

LAYERS = {"utils": 0, "kernels": 0, "models": 1, "criterions": 2, "generation": 2, "tasks": 3, "hub": 4, "bench": 4}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_imports(path: pathlib.Path):
    """(imported module, line) for every import of the package in ``path``,
    at any depth; ``from . import x`` counts as ``package.x`` when x is a module."""
    name = module_name(path)
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("fairseq_specdec"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if resolves(sub) else target, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("fairseq_specdec")]
    return [(t, line) for t, line in found if t != name]


def resolves(module: str) -> bool:
    rel = pathlib.Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def layer(module: str):
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def graph():
    edges = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        edges[module_name(path)] = package_imports(path)
    return edges


def test_the_walk_sees_the_package():
    """Relative imports at module and function level resolve to modules."""
    edges = graph()
    targets = {m: {t for t, _ in ts} for m, ts in edges.items()}
    assert "fairseq_specdec.generation.state" in targets["fairseq_specdec.generation.speculative"]  # from .state import
    assert "fairseq_specdec.kernels.rowgemm" in targets["fairseq_specdec.generation.lean_verifier"]  # from ..kernels import rowgemm
    assert "fairseq_specdec.bench.ct2" in targets["fairseq_specdec.bench.worker"]  # inside a function


@pytest.mark.parametrize("kind", ["upward", "cycle"])
def test_the_checks_catch_what_they_look_for(kind):
    """The checks below fail on a made-up graph with the fault."""
    if kind == "upward":
        edges = {"fairseq_specdec.models.a": [("fairseq_specdec.generation.b", 3)]}
        assert upward_imports(edges)
    else:
        edges = {
            "fairseq_specdec.bench.a": [("fairseq_specdec.bench.b", 1)],
            "fairseq_specdec.bench.b": [("fairseq_specdec.bench.a", 2)],
        }
        assert find_cycle(edges)


def upward_imports(edges):
    bad = []
    for module, targets in edges.items():
        mine = layer(module)
        if mine is None:
            continue
        for target, line in targets:
            theirs = layer(target)
            if theirs is not None and theirs > mine:
                bad.append(f"{module}:{line} imports {target}")
    return bad


def find_cycle(edges):
    WHITE, GREY, BLACK = 0, 1, 2
    color = {m: WHITE for m in edges}
    stack = []

    def visit(m):
        color[m] = GREY
        stack.append(m)
        for t, _ in edges.get(m, []):
            if t not in edges:
                continue
            if color[t] == GREY:
                return stack[stack.index(t):] + [t]
            if color[t] == WHITE:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        color[m] = BLACK
        return None

    for m in edges:
        if color[m] == WHITE:
            found = visit(m)
            if found:
                return found
    return None


def test_no_upward_imports():
    assert upward_imports(graph()) == []


def test_no_import_cycles():
    # a package's __init__ importing its own modules is how packages work;
    # only module-to-module cycles count
    edges = {m: [(t, line) for t, line in ts if not m.startswith(t + ".") and t != m] for m, ts in graph().items()}
    edges = {m: [(t, line) for t, line in ts if not t.startswith(m + ".")] for m, ts in edges.items()}
    assert find_cycle(edges) is None


def test_compat_imports_nothing_of_the_package():
    assert graph()["fairseq_specdec.compat"] == []


def importers_of(edges, prefix):
    return sorted({m for m, ts in edges.items() for t, _ in ts if t == prefix or t.startswith(prefix + ".")})


def test_native_code_is_one_package_imported_by_the_generation_layer_only():
    """The C++ sources and their bindings live under fairseq_specdec/kernels;
    models, criteria and the task never import native code (the generation
    layer decides where it runs: fairseq_specdec.generation.backend)."""
    files = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*") if p.suffix in (".cpp", ".h", ".cu"))
    assert files and all(f.startswith("kernels/") for f in files), files
    import re

    bindings = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                      if re.search(r"import _native\b|\._native\b", p.read_text()))
    assert all(b.startswith("kernels/") for b in bindings), bindings
    allowed = ("fairseq_specdec.kernels", "fairseq_specdec.generation", "fairseq_specdec.bench")
    bad = [m for m in importers_of(graph(), "fairseq_specdec.kernels") if not m.startswith(allowed)]
    assert bad == [], bad


#: where a concrete drafter class may be named: its definition, the registry's
#: builders (generation/build.py) and the package's public exports
DRAFTER_HOMES = ("generation/drafters/", "generation/ngram.py", "generation/build.py", "generation/__init__.py")


def test_only_the_registry_names_concrete_drafters():
    """bench/ and the loop know drafters by the Drafter contract only, so a
    decoding registered by another plugin is benchmarked and profiled by its
    own parts (the TimedParts capability, else the contract's calls), never as
    one of the built-in ones."""
    import fairseq_specdec  # noqa: F401
    from fairseq_specdec.generation.drafters import Drafter

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    names = {c.__name__ for c in subclasses(Drafter) if c.__module__.startswith("fairseq_specdec.")}
    assert {"NoDrafter", "NgramDrafter", "VerifierStateDrafter"} <= names
    bad = []
    for path in sorted(list((PACKAGE / "generation").rglob("*.py")) + list((PACKAGE / "bench").rglob("*.py"))):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(DRAFTER_HOMES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id in names:
                bad.append(f"{rel}:{node.lineno} {node.id}")
            elif isinstance(node, ast.alias) and node.name in names:
                bad.append(f"{rel} imports {node.name}")
    assert bad == [], bad


def test_the_drafter_contract_is_declared():
    """Every method the loop, the builder or the benchmark calls on a drafter
    is declared on Drafter or on the capability it belongs to; the ones a
    drafter (or a capability) must give are abstract."""
    import fairseq_specdec  # noqa: F401
    from fairseq_specdec.generation.drafters import Drafter, PathDrafter, StaticDrafter, TimedParts, TreeDrafter

    for name in ("describe", "start_batch", "propose", "update", "reorder", "default_block"):
        assert callable(getattr(Drafter, name, None)), name
    assert Drafter.__abstractmethods__ == {"describe", "start_batch", "propose", "reorder"}
    assert TreeDrafter.__abstractmethods__ == {"propose_tree"}
    assert PathDrafter.__abstractmethods__ == {"tree_paths"}
    assert StaticDrafter.__abstractmethods__ == {"static_inputs", "static_key"}
    assert TimedParts.__abstractmethods__ == {"timed_parts"}
    assert not hasattr(Drafter, "timed_parts")  # profiling is a capability, not the contract
    with pytest.raises(TypeError):
        type("Half", (Drafter,), {"propose": lambda self, state, k: None})()
    with pytest.raises(TypeError):  # a tree drafter without its trees
        type("NoTrees", (Drafter, TreeDrafter), {"describe": None, "start_batch": None, "propose": None,
                                                 "reorder": None})()


def test_the_plugins_models_provide_every_declared_member(tmp_path):
    """Each model class provides every method its capability protocol
    declares (models/protocol.py); the attributes are checked on built
    models by the tests that train them."""
    import fairseq_specdec  # noqa: F401
    from fairseq_specdec.models import protocol
    from fairseq_specdec.models.blockwise_transformer import BlockwiseTransformerModel
    from fairseq_specdec.models.specdec_nat import SpecDecNATModel
    from fairseq_specdec.models.specdec_vsd import SpecDecVSDModel

    for model, proto in ((SpecDecNATModel, protocol.SourceReadingDrafterModel),
                         (SpecDecVSDModel, protocol.VerifierStateDrafterModel),
                         (BlockwiseTransformerModel, protocol.BlockwiseHeadsModel)):
        assert issubclass(model, proto)
        attributes, methods = protocol.declared_members(proto)
        assert methods, proto
        for name in methods:
            mine = next(vars(c)[name] for c in model.__mro__ if name in vars(c))
            assert mine is not vars(proto).get(name) and not any(
                mine is vars(p).get(name) for p in proto.__mro__), f"{model.__name__} lacks {name}"
    # the declared attributes are the ones the layers above read
    assert "output_weight" in protocol.declared_members(protocol.VerifierStateDrafterModel)[0]
    assert "train_block_size" in protocol.declared_members(protocol.SourceReadingDrafterModel)[0]
