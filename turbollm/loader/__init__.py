"""Loading a model: checkpoint files → config, tokenizer and a model with its weights in place."""

from turbollm.loader.model_loader import LoadedModel, ModelDescription, describe_model, load_model

__all__ = ["LoadedModel", "ModelDescription", "describe_model", "load_model"]
