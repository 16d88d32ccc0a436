from .draft_verify import DraftVerifyConfig, DraftVerifyTask  # noqa: F401
