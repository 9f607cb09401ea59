"""Single held-out chat prompts, one after another, as users send them: specgen against llama-cpp-python.

Three arms in one process on the pipeline's GGUF (the default model unless overrides say otherwise),
taken in turn prompt by prompt (the order rotates, so drift in the machine's load falls on every
arm alike), each keeping what it keeps between requests as a user's process would:

* ``specgen plain``: ``pipe.generate(messages)`` with ``drafter=none`` (its prefix cache on, the default);
* ``specgen``: the same with the configured drafter (``drafter.num_tokens=auto`` by default);
* ``llama-cpp-python``: ``Llama.create_chat_completion(messages)`` on one ``Llama`` of the same file and
  thread count (it keeps the last prompt's KV and decodes only what differs).

Every arm is greedy (temperature 0), with the model's chat template and ``--max-new-tokens``; prefill is
included in each request's wall time. The prompts are held-out ShareGPT first turns and HumanEval stubs
(``specgen.bench.prompts``; the builtin sets where the datasets are not installed), the same for every arm.

    python scripts/chat_completion_bench.py [--prompts 8] [--max-new-tokens 128] [--threads 1] [override ...]

Prints per arm the total wall time, the tokens generated, tokens per second (prefill included) and its
ratio to llama-cpp-python's, the median request time, and how many replies equal llama-cpp-python's text.
Wall-clock numbers depend on machine load: report the load with them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import specgen
from specgen.bench.llama_baselines import llama_for
from specgen.bench.prompts import load_prompt_sets, sharegpt_path


def held_out(count: int) -> list[list[dict]]:
    """``count`` ShareGPT first turns and ``count`` HumanEval stubs, as single-message chats."""
    chat = "sharegpt" if sharegpt_path() is not None else "builtin"
    prompts = load_prompt_sets([chat], count) + load_prompt_sets(["humaneval"], count)
    out = []
    for prompt in prompts:
        text = prompt.prompt if isinstance(prompt.prompt, str) else prompt.prompt[-1]["content"]
        out.append([{"role": "user", "content": text}])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="per set (ShareGPT and HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", default="1")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    common = (f"threads={args.threads}", "sampling.temperature=0", *args.overrides)
    plain = specgen.pipeline(*common, "drafter=none", progress=False)
    spec = specgen.pipeline(*common, progress=False)
    llm = llama_for(plain)
    chats = held_out(args.prompts)

    def run_specgen(pipe):
        return lambda messages: pipe.generate(messages, max_new_tokens=args.max_new_tokens)

    def run_llama(messages):
        out = llm.create_chat_completion(messages=messages, max_tokens=args.max_new_tokens, temperature=0.0)
        return out["choices"][0]["message"]["content"] or "", out["usage"]

    arms = {"specgen plain": run_specgen(plain), "specgen": run_specgen(spec), "llama-cpp-python": run_llama}
    for messages in chats[:1]:  # warm-up, not counted: cost tables, first allocations, the template
        for run in arms.values():
            run(messages)
    walls = {name: [] for name in arms}
    tokens = dict.fromkeys(arms, 0)
    texts = {name: [] for name in arms}
    prompt_tokens = []
    for i, messages in enumerate(chats):
        names = list(arms)
        names = names[i % len(names):] + names[: i % len(names)]
        for name in names:
            start = time.perf_counter()
            result = arms[name](messages)
            walls[name].append(time.perf_counter() - start)
            if name == "llama-cpp-python":
                text, usage = result
                tokens[name] += usage["completion_tokens"]
                prompt_tokens.append((usage["prompt_tokens"], len(plain.encode(messages))))
            else:
                text = result.text
                tokens[name] += len(result.token_ids)
            texts[name].append(text)
    base = tokens["llama-cpp-python"] / sum(walls["llama-cpp-python"])
    same_prompt = sum(a == b for a, b in prompt_tokens)
    print(f"model {plain.config.target.get('name')}  prompts {len(chats)}  threads {args.threads}  "
          f"max_new_tokens {args.max_new_tokens}  prompts tokenized alike by both: {same_prompt}/{len(chats)}")
    for name in arms:
        rate = tokens[name] / sum(walls[name])
        same = sum(a == b for a, b in zip(texts[name], texts["llama-cpp-python"]))
        print(f"{name:17s} total {sum(walls[name]):7.2f} s  tokens {tokens[name]:5d}  {rate:6.1f} tok/s  "
              f"x llama-cpp-python {rate / base:5.2f}  median request {statistics.median(walls[name]) * 1e3:7.1f} ms  "
              f"text = llama-cpp-python's {same}/{len(chats)}")


if __name__ == "__main__":
    main()
