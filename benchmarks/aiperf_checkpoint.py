"""Write the `tiny` preset as a checkpoint directory with a Hugging Face tokenizer, for aiperf.

aiperf counts tokens (and synthesises its agentic prompts) with a Hugging Face tokenizer loaded
from `--tokenizer PATH`; the `tiny` preset's byte tokenizer is not one. This writes the preset's
seeded random weights beside a small byte-level BPE `tokenizer.json` (vocabulary within the
model's) and a chat template, so that `tokenspeed serve DIR` and `aiperf profile --tokenizer DIR`
read the same tokens. docs/perf/aiperf.md has the commands.

    python benchmarks/aiperf_checkpoint.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.hf_writer import save_checkpoint
from tokenspeed.model.init import init_random_weights

SPECIALS = ["<|im_end|>", "<|im_start|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Text the BPE merges are learned from: code and prose, as agentic prompts hold.
CORPUS = [
    "def read_file(path):\n    with open(path) as f:\n        return f.read()\n",
    "The tool returned the contents of the file. Next, run the tests and fix the failure.",
    "for i in range(10):\n    total += values[i] * weights[i]\nprint(total)\n",
    "user assistant system: please summarise the diff and propose a patch.",
]


def write(root: Path, seed: int = 0) -> Path:
    config = get_preset("tiny")
    save_checkpoint(init_random_weights(KimiForCausalLM(config), seed=seed), root)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(config.vocab_size, 400),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
    )
    tok.train_from_iterator(CORPUS * 50, trainer)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "chat_template": TEMPLATE,
            }
        )
    )
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(write(args.out, args.seed))


if __name__ == "__main__":
    main()
