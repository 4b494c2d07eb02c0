"""An SVGP with the continuous Bernoulli likelihood on soft labels from a real data set."""

import gpytorch
import pytest
import torch

from gpsd.likelihoods import ContinuousBernoulli, ContinuousBernoulliLikelihood

sklearn = pytest.importorskip("sklearn")


class _BernoulliLogitLikelihood(gpytorch.likelihoods.likelihood._OneDimensionalLikelihood):
    """The misspecified alternative: Bernoulli-logistic log-density y f - log(1 + e^f) on y in [0, 1]."""

    def forward(self, function_samples, *args, **kwargs):
        f = function_samples

        class _Soft(torch.distributions.Distribution):
            arg_constraints = {}

            def __init__(self):
                super().__init__(batch_shape=f.shape, validate_args=False)

            def log_prob(self, y):
                return y * f - torch.nn.functional.softplus(f)

        return _Soft()


class _SVGP(gpytorch.models.ApproximateGP):
    def __init__(self, inducing):
        strategy = gpytorch.variational.VariationalStrategy(
            self,
            inducing,
            gpytorch.variational.CholeskyVariationalDistribution(inducing.shape[0]),
            learn_inducing_locations=False,
        )
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        self.covar_module.base_kernel.lengthscale = 4.0
        self.covar_module.outputscale = 4.0

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _fit(likelihood, x, y, inducing, iters=40):
    torch.manual_seed(0)
    model = _SVGP(inducing).double()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=y.numel())
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(iters):
        opt.zero_grad()
        (-mll(model(x), y)).backward()
        opt.step()
    return model


def test_svgp_with_continuous_bernoulli_recovers_probabilities_better():
    from sklearn.datasets import load_breast_cancer
    from sklearn.linear_model import LogisticRegression

    data = load_breast_cancer()
    x = torch.as_tensor(data.data, dtype=torch.float64)
    x = (x - x.mean(0)) / x.std(0)
    labels = torch.as_tensor(data.target, dtype=torch.float64)
    # real-data latent: a regularised logistic regression on the real labels
    clf = LogisticRegression(C=0.02, max_iter=1000).fit(x.numpy(), labels.numpy())
    g = torch.as_tensor(clf.decision_function(x.numpy()), dtype=torch.float64).clamp(-6, 6)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(x.shape[0], generator=gen)
    train, test = perm[:200], perm[200:]
    torch.manual_seed(1)
    soft = ContinuousBernoulli(g[train]).sample()  # soft labels in [0, 1] drawn given the latent
    inducing = x[train][:25].clone()
    results = {}
    for name, likelihood in [
        ("cb", ContinuousBernoulliLikelihood()),
        ("bern", _BernoulliLogitLikelihood()),
    ]:
        model = _fit(likelihood, x[train], soft, inducing)
        model.eval()
        with torch.no_grad():
            post = model(x[test])
            nodes = torch.randn(2000, 1, dtype=torch.float64, generator=gen)
            prob = torch.sigmoid(post.mean + post.variance.sqrt() * nodes).mean(0)
        results[name] = (prob - torch.sigmoid(g[test])).square().mean().sqrt().item()
    print(results)
    assert results["cb"] < 0.8 * results["bern"], results
