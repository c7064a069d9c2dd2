"""The data every layer shares and derives nothing above: the static options of a call, group lists and their metadata, grouped layouts, quantized operands, the finishing step, errors."""
