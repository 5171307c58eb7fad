"""What users do with a running testbed: launch unmodified training and measure it."""
