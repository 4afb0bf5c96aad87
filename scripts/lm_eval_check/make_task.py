"""Write a small local lm-evaluation-harness task from WikiText-2 (../shared/data): each doc is a sentence
whose last word is to be predicted. Two tasks read the same docs: `turbollm_lastword_ll` (log-likelihood of
the last word: `echo` + `logprobs` on /v1/completions) and `turbollm_lastword_gen` (greedy generation until
a space or newline, exact match). Usage: python make_task.py OUT_DIR [N_DOCS]."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target{trim}}}}}"
{extra}metric_list:
  - metric: {metric}
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def docs(n: int) -> list[dict]:
    out = []
    for line in DATA.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("=") or "@" in line:
            continue
        for sentence in re.split(r"(?<=\.) ", line):
            words = sentence.rstrip(" .").split(" ")
            if 12 <= len(words) <= 40 and words[-1].isalpha():
                out.append({"context": " ".join(words[:-1]), "target": " " + words[-1]})
                if len(out) == n:
                    return out
    return out


def main() -> None:
    folder = Path(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "lastword.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs(n)))
    (folder / "turbollm_lastword_ll.yaml").write_text(TASK.format(
        name="turbollm_lastword_ll", data=data, output_type="loglikelihood", extra="", metric="acc", trim=""))
    (folder / "turbollm_lastword_gen.yaml").write_text(TASK.format(
        name="turbollm_lastword_gen", data=data, output_type="generate_until", metric="exact_match", trim=" | trim",
        extra='generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 8\n  do_sample: false\n'
              'filter_list:\n  - name: strip\n    filter:\n      - function: remove_whitespace\n'
              '      - function: take_first\n'))
    print(f"{n} docs -> {folder}")


if __name__ == "__main__":
    main()
