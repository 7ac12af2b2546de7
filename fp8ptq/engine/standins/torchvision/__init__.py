"""An import-only stand-in for torchvision in fp8ptq's SGLang subprocess: see ../standin.py."""

from standin import install

install(__name__, globals())
