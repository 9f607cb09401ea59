"""Shared fixtures: tiny pipelines (single-threaded, float32) and helpers."""

from __future__ import annotations

import logging
import os
import pathlib

import pytest

import specgen
from specgen.planning import BatchCostTable, CostTable

#: invariant_verify=true: the tiny float32 models verify exactly as single-token steps compute (measured
#: at load), so tests of exactness run an `exact`/`greedy` path; without it the fast path is approximate.
TINY = ("target=tiny", "threads=1", "dtype=float32", "invariant_verify=true")
#: The cost table every test pipeline plans with (num_tokens=auto): fixed, so plans never depend on
#: this machine's speed, and cheap enough that the planner speculates. test_costmodel measures for real.
TEST_COSTS = CostTable(chain=tuple(1 + 0.05 * n for n in range(17)), tree=tuple(1 + 0.05 * n for n in range(17)),
                       draft_per_token=0.05, step_s=1e-3)


#: The batched steps' table likewise (fixed and cheap: 8 rows cost 1.2 forwards, each width step 0.075 more).
TEST_BATCH_COSTS = BatchCostTable((1, 8), (1, 17), ((1.0, 1.8), (1.2, 2.4)), step_s=1e-3)


def fix_costs(monkeypatch) -> None:
    """Pipelines plan from TEST_COSTS / TEST_BATCH_COSTS alone (monkeypatch: pytest's, or a
    ``pytest.MonkeyPatch()`` in a test's child process)."""
    monkeypatch.setattr("specgen.planning.cost_cache.cost_table", lambda subject, **kwargs: TEST_COSTS)
    monkeypatch.setattr("specgen.planning.cost_cache.batch_cost_table", lambda subject, size, new_batch, **kwargs:
                        TEST_BATCH_COSTS)
    monkeypatch.setattr("specgen.planning.cost_cache.observer", lambda observe_costs: None)  # plans from the table alone


#: Memory one test worker may need: two workers' process trees peaked at 7.8 GiB together in a full run.
WORKER_MEMORY = 4 * 2**30


def _one_file(args: list[str]) -> bool:
    """Whether the command line names a single test file (or tests inside one)."""
    files = {arg.split("::", 1)[0] for arg in args}
    return len(files) == 1 and pathlib.Path(next(iter(files))).is_file()


def _workers() -> int:
    """One worker per CPU this process may run on, no more than the memory holds (WORKER_MEMORY each)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return cpus
    return max(1, min(cpus, memory // WORKER_MEMORY))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The default run uses every core: with pytest-xdist loaded, no ``-n`` given, not inside a worker and
    more than one file to run, it runs ``-n N --dist loadfile``: N workers (:func:`_workers`, or
    ``$PYTEST_XDIST_AUTO_NUM_WORKERS``), each file's tests on one worker, so a module-scoped pipeline is
    built once. ``-n0`` or ``-p no:xdist`` run in this process; the worker count only changes how fast
    the run is, never what a test asserts."""
    if (config.pluginmanager.hasplugin("xdist") and getattr(config.option, "numprocesses", 0) is None
            and not hasattr(config, "workerinput") and not _one_file(config.args)):
        config.option.numprocesses = "logical" if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") else _workers()
        if config.option.dist == "no":
            config.option.dist = "loadfile"


@pytest.fixture(autouse=True)
def _fixed_cost_table(monkeypatch):
    fix_costs(monkeypatch)



def _specgen_loggers() -> dict[str, logging.Logger]:
    return {name: logger for name, logger in logging.Logger.manager.loggerDict.items()
            if isinstance(logger, logging.Logger) and (name == "specgen" or name.startswith("specgen."))}


@pytest.fixture(autouse=True)
def _specgen_logging_restored():
    """A CLI run in-process reconfigures logging (Hydra's job logging disables the loggers that exist,
    specgen-serve's ``show_log`` stops specgen's from propagating): each test leaves specgen's loggers
    as it found them, and a logger it created as Python makes one, so no test depends on another's order."""
    before = {name: (lg.disabled, lg.propagate, lg.level, list(lg.handlers)) for name, lg in _specgen_loggers().items()}
    yield
    for name, logger in _specgen_loggers().items():
        logger.disabled, logger.propagate, logger.level, handlers = before.get(name, (False, True, logging.NOTSET, []))
        logger.handlers[:] = handlers


@pytest.fixture
def settled_shadows(monkeypatch) -> list[bool]:
    """Every :meth:`AcceptanceHistory.settle` call of the test, in order: True where it settled a shadow
    (a draft was expected and the plain step committed a token)."""
    from specgen.planning import AcceptanceHistory

    settled: list[bool] = []
    settle = AcceptanceHistory.settle

    def counting(self, committed):
        settled.append(self.pending is not None and committed is not None)
        settle(self, committed)

    monkeypatch.setattr(AcceptanceHistory, "settle", counting)
    return settled


@pytest.fixture
def device_path(monkeypatch):
    """Argmax takes the device's (torch's) path on CPU tensors too: for tests that count a device's
    reads on the CPU (specgen.sampling.probs.HOST_NUMPY off)."""
    monkeypatch.setattr("specgen.sampling.probs.HOST_NUMPY", False)

def tiny_pipeline(*overrides: str, drafter: str = "tiny"):
    """A pipeline on the tiny random models with extra CLI-style overrides."""
    return specgen.pipeline(*TINY, f"drafter={drafter}", *overrides, progress=False)


@pytest.fixture
def make_tiny():
    return tiny_pipeline


#: The tree the forward-vs-paths check uses: a 5-token prefix and 6 nodes in 3 levels.
TREE_PREFIX, TREE_NODES, TREE_PARENTS = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [-1, -1, 0, 0, 2, 1]


def check_tree_forward_matches_each_path(lm):
    """One tree forward over TREE_NODES (after a cached part of TREE_PREFIX) gives, at every
    node, the logits of a plain forward over that node's path; returns the tree's cache."""
    import torch

    from specgen.sampling import ancestor_matrix, tree_depths, tree_paths

    cache = lm.new_cache()
    lm.forward(cache, TREE_PREFIX[:3], keep=1)
    out = lm.forward_tree(cache, TREE_PREFIX[3:], TREE_NODES, ancestor_matrix(TREE_PARENTS),
                          tree_depths(TREE_PARENTS), [])
    for i, path in enumerate(tree_paths(TREE_PARENTS)):
        reference = lm.forward(lm.new_cache(), TREE_PREFIX + [TREE_NODES[j] for j in path], keep=1)[0]
        torch.testing.assert_close(out.logits(1 + i)[0], reference, atol=1e-4, rtol=1e-4)
    return cache


@pytest.fixture(scope="module")
def tiny_eagle_head(tmp_path_factory) -> str:
    """Path of a random float32 EAGLE head for the tiny target with an 8-token vocabulary
    (a tree drafter: its rounds go through the tree verifier)."""
    import torch

    from specgen.heads import HeadConfig, build_head, save_head, target_fingerprint

    target = specgen.pipeline(*TINY, "target.source.vocab_size=8", "drafter=none", progress=False)
    d = target.target.model.config.hidden_size
    cfg = HeadConfig(kind="eagle", hidden_size=d, draft_vocab_size=8, intermediate_size=2 * d, num_heads=4)
    torch.manual_seed(0)
    head = build_head(cfg, torch.arange(8))
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("heads") / "eagle.safetensors"
    return str(save_head(path, head, target_fingerprint(target.target.model), command="test", seed=0,
                         dtype=torch.float32))
