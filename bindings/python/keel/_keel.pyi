"""Type stubs of keel._keel, the native half of the keel package (pybind11 over include/keel/).

Use the keel package (keel.Config, keel.plan, keel.Engine, ...) rather than this module: it
checks dtypes, shapes and devices before buffers cross by address. Every function raises the
keel.KeelError subclass of the library's status (keel._errors) with the library's message.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

__version__: str
with_cuda: bool
with_nccl: bool
with_ucx: bool
with_mpi: bool

class Config:
    """The configuration (docs/config.md) behind an opaque handle; Config() is the defaults."""
    def __init__(self) -> None: ...
    @staticmethod
    def from_yaml(yaml: str, source: str = "<config>") -> Config: ...
    @staticmethod
    def from_file(path: str) -> Config: ...
    @staticmethod
    def reference() -> str: ...
    def to_yaml(self) -> str: ...
    @property
    def num_ranks(self) -> int: ...
    @property
    def policy(self) -> str: ...
    def __eq__(self, other: object) -> bool: ...

class Trace:
    """A routing trace in memory (include/keel/trace.hpp)."""
    description: str
    num_layers: int
    num_experts: int
    num_sources: int  # 0: per-expert counts only
    step_ids: List[int]  # [num_steps]
    @property
    def num_steps(self) -> int: ...
    def counts_bytes(self) -> bytes:
        """float64, [num_steps, num_layers, num_sources or 1, num_experts], native byte order."""

def read_trace(path: str, format: str = "auto") -> Trace: ...
def synthetic_trace(seed: int, num_steps: int, num_layers: int, num_experts: int,
                    num_sources: int, tokens_per_source: int, top_k: int,
                    zipf_exponent: float) -> Trace: ...
def condense_rows(rows: int, num_rows: int, hidden: int, bucket_begin: int, num_buckets: int,
                  threshold: float, window: int, representative: int, kept: int) -> None:
    """keel::CondenseRows (include/keel/condense.hpp) over float32 rows at an address, writing
    representative [num_rows] and kept [num_buckets] int32."""
    ...
def policy_names() -> List[str]: ...

def plan(policy: str, weight: bytes, num_layers: int, num_experts: int, num_replicas: int,
         num_groups: int, num_nodes: int, num_gpus: int,
         config: Optional[Config] = None) -> Dict[str, Any]:
    """weight: float64 bytes, [num_layers, num_experts]. Returns num_layers, num_experts,
    num_replicas, max_copies and flat int lists phy2log [num_layers * num_replicas], log2phy
    [num_layers * num_experts * max_copies] (padded with -1), logcnt [num_layers * num_experts]."""

def replay(trace: Trace, config: Optional[Config] = None, policies: Sequence[str] = ...,
           oracle: bool = False, include_series: bool = True) -> str:
    """The report of `keel replay --report`, as JSON text."""

class Engine:
    """One rank's engine over a Python communicator object (keel.torch.ProcessGroupCommunicator
    or any object with rank, size, all_gather, barrier, all_reduce, broadcast, all_to_all_v).

    Optional on the communicator, looked up once at construction:
    all_to_all_v_known(send: memoryview, send_bytes: list[int], recv: memoryview,
    recv_bytes: list[int], timeout: float) -> None fills recv (writable, len = sum(recv_bytes))
    with what each rank sends, every size known on both sides (without it the engine's slot
    exchanges run all_to_all_v and compare the sizes); moves_device_memory: bool with
    all_to_all_v_device(send: int, send_bytes: list[int], recv: int, recv_bytes: list[int],
    timeout: float) -> None moves device buffers given by address, returning once recv holds
    the data (used with memory="cuda" instead of staging through host memory)."""
    def __init__(self, communicator: Any, config: Optional[Config] = None, config_yaml: str = "",
                 config_path: str = "", *, num_layers: int, num_experts: int, top_k: int,
                 weight_bytes: int, gradient_bytes: int, optimizer_bytes: int,
                 gradient_type: str = "float32", mp_group_size: int = 1,
                 memory: str = "host") -> None:
        """memory: where the slot buffers live, "host" or "cuda" (device memory of the GPU
        current on the creating thread)."""
    def close(self) -> None: ...
    def register_slot(self, layer: int, local_slot: int, weights: int, gradients: int,
                      optimizer: int) -> None:
        """Buffers by address (a tensor's data_ptr(); 0 for none)."""
    def plan_sequences(self, first_layer: int, num_sequences: int, tokens: int, expert_rows: int,
                       row_size: int, max_token_imbalance: float,
                       move_bytes_per_token: float, objective: str) -> Dict[str, Any]:
        """Engine::PlanSequences; tokens: [num_sequences] int64 at an address, expert_rows:
        [num_sequences * row_size] int32 at an address."""
        ...
    def route(self, layer: int, topk_ids: int, num_entries: int, slot_out: int) -> Dict[str, Any]:
        """topk_ids: address of [num_entries] int32; slot_out: address of [num_entries] int32,
        written. Returns send_counts [num_ranks], recv_counts [num_ranks * local_slots],
        recv_totals [num_ranks], local_experts [local_slots], epoch, share_begin and share_end
        (the tokens this rank routes), and the quota table the slots came from (LayerRoute):
        copy_begin [num_experts + 1], copy_slot [num_copies], copy_quota [num_copies] and
        slot_rank [num_slots + num_ranks * transient_per_rank]."""
    def route_counts(self, layer: int, expert_counts: int) -> Dict[str, Any]:
        """Engine::RouteCounts. expert_counts: address of [num_experts] int32 on the host, this
        rank's entries per expert. Returns route's keys (share_begin and share_end 0); the
        trainer assigns slots from the quota table."""
    def reduce_gradients(self) -> None: ...
    def step_end(self) -> None: ...
    def home_slots(self, layer: int) -> List[Tuple[int, int]]: ...
    def placement(self, layer: int) -> Dict[str, Any]: ...
    def stats(self) -> Dict[str, Any]: ...
    def save_state(self) -> str: ...
    def restore_state(self, state: str) -> None: ...
    def save_experts(self, dir: str) -> None: ...
    def load_experts(self, dir: str) -> None: ...
    def locate_slot(self, slot: int) -> Tuple[int, int]: ...
    @property
    def rank(self) -> int: ...
    @property
    def num_ranks(self) -> int: ...
    @property
    def slots_per_rank(self) -> int: ...
    @property
    def transient_per_rank(self) -> int: ...
    @property
    def epoch(self) -> int: ...
