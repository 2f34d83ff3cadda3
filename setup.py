"""aadet: Attention Augmented and Stand-Alone Self-Attention detectors for Detectron2.

Detectron2 itself is not on the package index and is not declared here: install it first
(official source, see README), or run ``make setup`` for the documented offline route.
"""
from setuptools import find_packages, setup

setup(
    name="aadet",
    version="0.1.0",
    description="Self-attention (AA, SASA) backbones, FPN and RetinaNet heads for Detectron2",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["aadet", "aadet.*"]),
    package_data={
        "aadet.layers.functional": ["route_table_cuda.json"],  # impl="auto"'s CUDA routes
        "aadet.layers.functional.backends": ["csrc/*.cpp"],
    },
    python_requires=">=3.8",
    install_requires=[
        "torch>=2.1",
        "torchvision>=0.16",
        "pycocotools>=2.0.2",
        "fvcore>=0.1.5",
        "iopath>=0.1.7",
        "opencv-python-headless",
        "numpy",
        "Pillow>=7.1",
        "matplotlib",
        "tabulate",
        "tensorboard",
        "psutil",
        # Detectron2's own companions (its wheel/source declares them too):
        "yacs>=0.1.8",
        "termcolor>=1.1",
        "cloudpickle",
        "tqdm>4.29.0",
        "omegaconf>=2.1",
        "hydra-core>=1.1",
        "packaging",
        # builds the SASA C++ CPU kernel on first use (with the system's g++; see sasa_cpp.py)
        "ninja",
    ],
    extras_require={
        "dev": ["pytest>=7", "pytest-xdist>=3", "onnx>=1.15", "onnxruntime>=1.17", "ruff>=0.5"],
        # tools/export_model.py: ONNX files and running them (TorchScript needs nothing extra)
        "export": ["onnx>=1.15", "onnxruntime>=1.17"],
    },
)
