"""``python -m pipeline.hf card DIR [--eval reports/eval.json] [--out FILE]``: a packed directory's model card with
a run's scores (:func:`pipeline.hf.write.fill_card`)."""

import argparse
import sys

from pipeline.hf.write import fill_card

parser = argparse.ArgumentParser(prog="python -m pipeline.hf", description="packed model directories")
sub = parser.add_subparsers(dest="command", required=True)
card = sub.add_parser("card", help="write a packed directory's model card with this run's scores")
card.add_argument("directory")
card.add_argument("--eval", default="reports/eval.json")
card.add_argument("--out", default=None, help="default: DIRECTORY/README.md")
args = parser.parse_args()
try:
    print(fill_card(args.directory, args.eval, args.out))
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"pipeline.hf: {e}")
