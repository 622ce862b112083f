"""PyTorch's batched REINFORCE example (pytorch/examples
distributed/rpc/batch/reinforce.py), in our own words, with a tiny synthetic
environment instead of gym's CartPole: observers step their environments and
ask the agent for actions; the agent answers a whole batch at once through an
``@async_execution`` method whose Future the last observer's call completes."""

from __future__ import annotations

import threading
from typing import Any

import flavors
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

M: Any = None
GAMMA = 0.99


class ToyEnv:
    """Keep a drifting point near zero: action 0 pushes left, 1 right."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.state = torch.zeros(4)

    def reset(self) -> torch.Tensor:
        self.state = 0.1 * torch.randn(4, generator=self.g)
        return self.state.clone()

    def step(self, action: int) -> tuple[torch.Tensor, float, bool]:
        push = 0.15 if action == 1 else -0.15
        drift = 0.05 * torch.randn(4, generator=self.g)
        self.state = self.state + drift
        self.state[0] += push + 0.3 * self.state[1]
        self.state[1] = 0.9 * self.state[1] + 0.1 * self.state[0]
        return self.state.clone(), 1.0, bool(abs(self.state[0]) > 1.0)


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 32)
        self.dropout = nn.Dropout(p=0.2)
        self.affine2 = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.dropout(self.affine1(x)))
        return F.softmax(self.affine2(x), dim=2)


class Observer:
    def __init__(self) -> None:
        self.id = M.rpc.get_worker_info().id - 1
        self.env = ToyEnv(seed=10 + self.id)

    def run_episode(self, agent_rref: Any, n_steps: int) -> list[Any]:
        state = self.env.reset()
        rewards = torch.zeros(n_steps)
        start, ep_reward = 0, n_steps
        for step in range(n_steps):
            action = M.rpc.rpc_sync(
                agent_rref.owner(),
                Agent.select_action_batch,
                args=(agent_rref, self.id, state.unsqueeze(0)),
            )
            state, reward, done = self.env.step(action)
            rewards[step] = reward
            if done or step + 1 >= n_steps:
                ret = 0.0
                for i in range(step, start - 1, -1):
                    ret = float(rewards[i]) + GAMMA * ret
                    rewards[i] = ret
                state = self.env.reset()
                if start == 0:
                    ep_reward = min(ep_reward, step - start + 1)
                start = step + 1
        return [rewards, ep_reward]


class Agent:
    def __init__(self, world_size: int) -> None:
        self.ob_rrefs = []
        self.agent_rref = M.rpc.RRef(self)
        self.policy = Policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=3e-2)
        for ob_rank in range(1, world_size):
            info = M.rpc.get_worker_info(f"observer{ob_rank}")
            self.ob_rrefs.append(M.rpc.remote(info, Observer))
        self.states = torch.zeros(len(self.ob_rrefs), 1, 4)
        self.saved_log_probs: list[torch.Tensor] = []
        self.future_actions = M.futures.Future()
        self.lock = threading.Lock()
        self.pending = len(self.ob_rrefs)

    @staticmethod
    def select_action_batch(agent_rref: Any, ob_id: int, state: torch.Tensor) -> Any:
        self = agent_rref.local_value()
        self.states[ob_id].copy_(state)
        action = self.future_actions.then(lambda f: f.wait()[ob_id].item())
        with self.lock:
            self.pending -= 1
            if self.pending == 0:
                self.pending = len(self.ob_rrefs)
                m = Categorical(self.policy(self.states.clone()))  # the original: .cuda(), a copy
                actions = m.sample()
                self.saved_log_probs.append(m.log_prob(actions).t()[0])
                fut, self.future_actions = self.future_actions, M.futures.Future()
                fut.set_result(actions)
        return action

    def run_episode(self, n_steps: int) -> float:
        futs = [ob.rpc_async().run_episode(self.agent_rref, n_steps) for ob in self.ob_rrefs]
        rets = M.futures.wait_all(futs)
        rewards = torch.stack([r[0] for r in rets]).t()
        ep_reward = sum(r[1] for r in rets) / len(rets)
        probs = torch.stack(self.saved_log_probs)
        (-probs * rewards / len(rets)).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.saved_log_probs = []
        self.states = torch.zeros(len(self.ob_rrefs), 1, 4)
        return float(ep_reward)


def _decorate() -> None:
    fn = Agent.__dict__["select_action_batch"].__func__
    fn = getattr(fn, "__wrapped__", fn)
    Agent.select_action_batch = staticmethod(M.rpc.functions.async_execution(fn))  # type: ignore[method-assign]


def run(rank: int, world: int, init_method: str, flavor: str, episodes: int = 6) -> Any:
    global M
    M = flavors.use(flavor)
    _decorate()
    torch.manual_seed(543)
    opts = flavors.options(flavor, init_method)
    out = None
    if rank == 0:
        M.rpc.init_rpc("agent", rank=rank, world_size=world, rpc_backend_options=opts)
        agent = Agent(world)
        out = [agent.run_episode(n_steps=30) for _ in range(episodes)]
    else:
        M.rpc.init_rpc(f"observer{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    M.rpc.shutdown()
    return out
