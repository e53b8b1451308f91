"""The stages of a turn, one module each, in the order the processor lists them."""
