"""Write audio_models.json: OpenAI's spec (openapi.json of github.com/openai/openai-openapi)
trimmed to /audio/transcriptions, /audio/translations and /models plus every component they
reference, served from /v1. Usage: python trim.py path/to/openapi.json > audio_models.json"""

import json
import sys

PATHS = ("/audio/transcriptions", "/audio/translations", "/models")


def trim(spec: dict) -> dict:
    def resolve(ref: str) -> dict:
        node = spec
        for part in ref[2:].split("/"):
            node = node[part]
        return node

    needed: set[str] = set()
    paths = {p: spec["paths"][p] for p in PATHS}
    todo: list = [paths]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref" and value.startswith("#/components/") and value not in needed:
                    needed.add(value)
                    todo.append(resolve(value))
                elif key != "$ref":
                    todo.append(value)
        elif isinstance(node, list):
            todo.extend(node)
    components: dict = {"securitySchemes": spec["components"]["securitySchemes"]}
    for ref in sorted(needed):
        _, _, kind, name = ref.split("/")
        components.setdefault(kind, {})[name] = resolve(ref)
    return {"openapi": spec["openapi"], "info": spec["info"], "servers": [{"url": "/v1"}],
            "security": spec["security"], "paths": paths, "components": components}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        json.dump(trim(json.load(f)), sys.stdout, indent=1)
