"""Test doubles, named as such: ``instant_engine`` answers generation requests without a model
(for scheduler tests and the control-plane benchmark)."""
