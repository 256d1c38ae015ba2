"""Runnable experiments: thin command lines over the jaxtrain library."""


def print_and_save(text: str, result: dict, json_path: str | None) -> int:
    """An experiment's end: its table on stdout, its figures to ``json_path`` if asked; exit code 0."""
    import json

    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {json_path}")
    return 0
