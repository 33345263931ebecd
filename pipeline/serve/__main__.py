from pipeline.serve import main

raise SystemExit(main(prog="python -m pipeline.serve"))
