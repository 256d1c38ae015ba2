"""Text from a finished language-model run (python -m experiments.gpt --out RUN_DIR): its saved model and tokenizer,
a prompt, and new tokens sampled one by one with a KV cache (jaxtrain.models.generate; one compiled call).

    python -m experiments.sample RUN_DIR --prompt "And God said" --tokens 100
    python -m experiments.sample RUN_DIR --prompt "In the beginning" --temperature 0 --tokens 40   # greedy
"""

import argparse
import sys

from jaxtrain.cli import DefaultsOnce, one_line_errors, whole_number


def _temperature(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: expected a finite number >= 0 (0: greedy)")
    return value


def _prompt(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("'': empty; leave --prompt out to start from a new line")
    return text


@one_line_errors("sample")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.sample", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsOnce, allow_abbrev=False)
    p.add_argument("run_dir", help="a finished language-model run's --out directory (model/, model.json, "
                                   "tokenizer.json)")
    p.add_argument("--prompt", type=_prompt, help="the text to go on from (default: a new line; at "
                                                                "most half the model's context is kept: its end)")
    p.add_argument("--tokens", type=whole_number(1), default=100,
                   help="new tokens to sample (the text stops at the model's context, --seq-len tokens)")
    p.add_argument("--temperature", type=_temperature, default=0.8, help="softmax temperature; 0: greedy")
    p.add_argument("--top-k", type=whole_number(1), default=40, help="sample among the k most likely tokens only")
    p.add_argument("--samples", type=whole_number(1), default=1, help="how many continuations (seeds seed, "
                                                                      "seed + 1, ...)")
    p.add_argument("--seed", type=int, default=0, help="the first sample's key")
    args = p.parse_args(argv)

    from jaxtrain.driver import export, language
    from jaxtrain.data import text
    from jaxtrain.errors import ConfigError
    from jaxtrain.models import LanguageModel

    meta = export.info(args.run_dir)
    model = export.model_of(meta)
    if not isinstance(model, LanguageModel):
        raise ConfigError(f"run_dir={args.run_dir}: holds a {meta['model']} model, not a language model (train one "
                          "with python -m experiments.gpt)")
    tokenizer_file = export.Path(args.run_dir) / export.TOKENIZER
    if not tokenizer_file.is_file():
        raise ConfigError(f"run_dir={args.run_dir}: has no {export.TOKENIZER} (a language-model run writes it when it "
                          "finishes); train it again")
    _, params, _ = export.load(args.run_dir)
    tokenizer = text.load_tokenizer(tokenizer_file)
    prompt = "\n" if args.prompt is None else args.prompt
    for sample in language.samples(model, params, tokenizer, [prompt] * args.samples, args.tokens,
                                   seed=args.seed, temperature=args.temperature,
                                   top_k=None if args.temperature == 0 else min(args.top_k, model.num_classes)):
        print(sample)
        if args.samples > 1:
            print("-" * 40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
