from lingua_zeco.reliability import clean_exit

from .cli import main

with clean_exit():  # bad input: one `error: ...` line, exit code 2
    raise SystemExit(main())
