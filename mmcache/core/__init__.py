"""The parts FeatureCache is made of, each owning its own state (docs/design.md)."""
