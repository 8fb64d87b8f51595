"""The decoder core: the baseline's components, each the default of one slot, and the loop."""
