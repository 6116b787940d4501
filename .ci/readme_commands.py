"""Print the README's two commands (set up + demo, tests), one per line, exactly as written there.

`.ci/run` runs what this prints, so CI cannot drift from the README: the commands are the
non-comment lines of the first ```bash block under the heading "From a clone: two commands".
"""

import re
import sys
from pathlib import Path

HEADING = "## From a clone: two commands"

readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
section = readme.split(HEADING, 1)[1]
block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
if len(commands) != 2:
    sys.exit(f"expected 2 commands in the README's '{HEADING}' block, found {len(commands)}: {commands}")
print("\n".join(commands))
