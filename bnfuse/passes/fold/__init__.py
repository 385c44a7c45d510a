"""Folding passes: BatchNormalization and per-channel ops into their neighbours, branch merges, their math."""
