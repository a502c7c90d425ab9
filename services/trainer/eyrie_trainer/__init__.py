"""eyrie trainer: hidden states -> EAGLE-3 drafter (speculators), evaluation, export."""
