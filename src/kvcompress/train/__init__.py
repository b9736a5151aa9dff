"""Training for methods that learn something: LESS kernels (``kvcompress.train.less``)."""
