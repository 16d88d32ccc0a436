"""The command line a result file records, readable on another machine."""
import os
import re
import sys
from typing import List, Optional


def recorded_command(argv: Optional[List[str]] = None, cwd: Optional[str] = None) -> str:
    """The program's name and its arguments (``sys.argv`` by default), with
    every absolute path under the working directory ``cwd`` written relative
    to it (also inside ``LABEL=PATH`` arguments): a result file then names the
    checkout's paths, not the directory of the machine it was made on."""
    args = list(sys.argv[1:] if argv is None else argv)
    root = os.path.abspath(cwd or os.getcwd()).rstrip(os.sep) + os.sep
    pattern = re.compile(re.escape(root))
    return " ".join([os.path.basename(sys.argv[0])] + [pattern.sub("", a) for a in args])
