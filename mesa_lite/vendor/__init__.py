"""Third-party files shipped unchanged with mesa_lite, each under its own license (named in its
first line): ``timm_train.py``, timm's ``train.py`` from pytorch-image-models, which
``python -m mesa_lite.timm_train --mesa-smoke`` runs offline."""
