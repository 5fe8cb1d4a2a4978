"""Configuration: YAML text -> validated, frozen model."""
