"""Which target architectures can feed EAGLE-3 in a vLLM release: read from its wheel's source.

Both `--speculative-config '{"method": "eagle3", ...}'` and `{"method": "extract_hidden_states"}`
end in vllm/v1/worker/gpu_model_runner.py `_setup_eagle3_aux_hidden_state_outputs`, which raises
"Model does not support EAGLE3 interface" unless the model class implements SupportsEagle3
(vllm/model_executor/models/interfaces.py: set_aux_hidden_state_layers). This script maps every
architecture name of vllm/model_executor/models/registry.py to its class and says whether that
class (or a class it inherits from) lists SupportsEagle3 among its bases.

    pip download vllm==0.33.0 --no-deps -d /tmp/w && unzip -q /tmp/w/vllm-*.whl 'vllm/*' -d /tmp/w/src
    python scripts/vllm_eagle3_table.py /tmp/w/src/vllm > eyrie/core/vllm_support.json
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


def class_bases(root: Path) -> dict[str, set[str]]:
    bases: dict[str, set[str]] = {}
    for file in [*(root / "model_executor" / "models").glob("*.py"), *(root / "models").rglob("*.py")]:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                bases.setdefault(f"{file.stem}.{node.name}", set()).update(names)
                bases.setdefault(node.name, set()).update(names)
    return bases


def supports(name: str, bases: dict[str, set[str]], seen: frozenset = frozenset()) -> bool:
    if name == "SupportsEagle3":
        return True
    if name in seen:
        return False
    return any(supports(b, bases, seen | {name}) for b in bases.get(name, ()))


def registry(models: Path) -> dict[str, tuple[str, str]]:
    """Every `"Arch": ("module", "Class")` entry of registry.py's dicts."""
    found = {}
    for node in ast.walk(ast.parse((models / "registry.py").read_text())):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if (isinstance(key, ast.Constant) and isinstance(value, ast.Tuple) and len(value.elts) == 2
                        and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts)):
                    found[key.value] = (value.elts[0].value, value.elts[1].value)
    return found


def main() -> None:
    root = Path(sys.argv[1])
    models = root / "model_executor" / "models"
    version = (root / "_version.py").read_text().split("version = ")[-1].split("\n")[0].strip("'\" ") \
        if (root / "_version.py").exists() else "unknown"
    bases = class_bases(root)
    rows = {arch: [_file(module), cls, supports(f"{module.rsplit('.', 1)[-1]}.{cls}", bases)]
            for arch, (module, cls) in sorted(registry(models).items())}
    print(json.dumps({"vllm": version, "read_from": READ_FROM, "columns": COLUMNS})[:-1] + ',\n "architectures": {')
    print(",\n".join(f"  {json.dumps(arch)}: {json.dumps(row)}" for arch, row in rows.items()) + "\n }\n}")


READ_FROM = ("vllm/model_executor/models/registry.py (architecture -> class) and the class's bases "
             "(SupportsEagle3, vllm/model_executor/models/interfaces.py); written by scripts/vllm_eagle3_table.py")
COLUMNS = ["file", "class", "implements SupportsEagle3"]


def _file(module: str) -> str:
    """registry.py names a module in models/ by its stem, others by their dotted path."""
    return module.replace(".", "/") + ".py" if "." in module else f"vllm/model_executor/models/{module}.py"


if __name__ == "__main__":
    main()
