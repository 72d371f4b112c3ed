"""One-line integrations with the trainers users run: ``compile_trainer(trainer)`` for Hugging Face ``Trainer`` and
TRL's ``SFTTrainer`` / ``GRPOTrainer`` (``tilecompile/integrations/trainers.py``)."""

from tilecompile.integrations.trainers import IntegrationError, compile_trainer

__all__ = ["IntegrationError", "compile_trainer"]
