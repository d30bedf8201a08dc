"""Print the README's "Set up" commands, one a line, exactly as a user copies them.

CI runs what this prints, so the commands it runs are the README's, not a copy of them."""

import re
import sys
from pathlib import Path

readme = Path(__file__).resolve().parents[1] / "README.md"
section = readme.read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
commands = re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)
if len(commands) != 2:
    sys.exit(f"README.md 'Set up' must hold two bash blocks (main job, tests); found {len(commands)}")
print("\n".join(command.strip() for command in commands))
