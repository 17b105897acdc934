"""What every weight type that stands in for an array as an nnx Variable's value shares (packed
panels, int8 and FP8 matrices, rows of quantized blocks): nnx reads a Variable's value as
`variable[...]`, which must give the whole weight."""
from __future__ import annotations


class ReadWhole:
    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError(f"{type(self).__name__} is read whole (`[...]`)")
        return self
