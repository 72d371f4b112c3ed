"""One-line integrations with the trainers users run: ``compile_trainer(trainer)`` for Hugging Face ``Trainer`` and
TRL's ``SFTTrainer`` / ``GRPOTrainer`` (``tilecompile/integrations/trainers.py``), and
``tilecompile.integrations.verl.compile_engine(engine)`` for verl 0.9's FSDP engine
(``tilecompile/integrations/verl.py``, imported on its own: it needs verl installed only when called)."""

from tilecompile.integrations.trainers import IntegrationError, compile_trainer

__all__ = ["IntegrationError", "compile_trainer"]
