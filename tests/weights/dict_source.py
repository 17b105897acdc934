"""A tensor source (xlaserve/weights/param_layout.py's protocol) over a dict of arrays, for unit tests of
what reads one."""


class DictSource:
    def __init__(self, tensors: dict):
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name: str):
        return self.tensors[name]
