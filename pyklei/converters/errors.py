"""The converter's error class."""


class ConversionError(ValueError):
    """A conversion cannot proceed: bad or missing input, unsupported feature, bad option.

    The message says what is wrong and, where there is one, what to do about it. A failed
    conversion never leaves an output file behind.
    """
