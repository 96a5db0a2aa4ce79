"""scripts/slurm_launch.sh hands the user's recipe path and overrides to `accelerate launch` on every node as they
were given: the real script runs here with stand-ins for srun, scontrol, scancel and accelerate on PATH (no cluster in
CI), the stand-in accelerate recording the arguments it received."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKES = {
    "srun": '#!/usr/bin/env bash\nshift\nexec "$@"\n',  # drops --kill-on-bad-exit=1, runs the step here
    "scontrol": "#!/usr/bin/env bash\necho node-a\n",
    "scancel": "#!/usr/bin/env bash\n",
    "accelerate": '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ACCELERATE_ARGV"\n',
}


def test_recipe_and_overrides_reach_accelerate_unsplit_and_unrun(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(stat.S_IRWXU)
    (bin_dir / "python").symlink_to(sys.executable)  # the script reads the recipe's output_dir with python
    argv_file, mark = tmp_path / "argv", tmp_path / "ran"
    recipe = str(tmp_path / "my recipes" / "a b.yaml")
    overrides = [f"output_dir={tmp_path / 'runs' / 'x y'}", f"data.train=[{{path: '$(touch {mark})'}}]", "seed=1;id"]
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "ACCELERATE_ARGV": str(argv_file),
        "SLURM_JOB_NODELIST": "node-a",
        "SLURM_JOB_ID": "1",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_GPUS_ON_NODE": "2",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm_launch.sh"), recipe, *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = argv_file.read_text().splitlines()
    assert args[args.index("--machine_rank") + 1] == "0" and args[args.index("--main_process_ip") + 1] == "node-a"
    assert args[args.index("scripts/finetune.py") :] == [
        "scripts/finetune.py",
        "--recipe",
        recipe,
        "checkpoint.resume=auto",
        *overrides,
    ]
    assert not mark.exists()
