import pytest

from router.classifier import DomainClassifier
from router.data import DataConfig
from router.train import TrainConfig, train


@pytest.fixture(scope="session")
def small_router():
    """(classifier, metrics, splits) trained on a subsample: a few seconds."""
    config = TrainConfig(data=DataConfig(per_class=1500, conversations=400, seed=1), max_features=8000)
    return train(config)


@pytest.fixture(scope="session")
def shipped_router():
    return DomainClassifier.load()
