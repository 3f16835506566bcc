"""`python -m colo`: print what this build of colo can do here."""
import json

import colo

info = colo.build_info()
print(json.dumps(info, indent=2))
if not info["cuda_available"]:
    print(f"CUDA is unavailable: {info['cuda_unavailable_reason']}")
