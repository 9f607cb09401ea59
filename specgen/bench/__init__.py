"""specgen-bench: the speculative-decoding performance matrix with side-by-side baselines.

Modules, in the order data flows:

``prompts``    prompt sets (JSONL files, ShareGPT, HumanEval, built-in fallbacks);
``runner``     builds one pipeline per temperature and runs every method prompt by
               prompt, interleaved, after an untimed warm-up -> per-prompt samples;
``baselines``  HF ``generate()``, assisted generation and prompt lookup on the same models;
``summary``    pure functions: samples -> per-cell rows (medians, spread, paired speedups,
               the speed model);
``report``     environment record, JSONL and markdown; ``plots``: the PNGs;
``cli``        the Hydra entry point (``specgen-bench``) and :func:`~specgen.bench.cli.run_bench`.

>>> from specgen.bench.cli import compose_bench, run_bench
>>> cfg = compose_bench(["target=tiny", "drafter=tiny", "threads=1", "bench.out_dir=null"])
>>> result = run_bench(cfg)  # doctest: +SKIP
"""
