"""Runs ``titan_sft.train`` (its arguments follow) under torchrun with point-to-point messages made synchronous, as
NCCL makes sends of large tensors: a send completes only once its receiver has posted the matching receive, and
each rank runs its point-to-point operations one at a time in the order it issued them (NCCL queues them on one
stream). A batch (``batch_isend_irecv``) is one NCCL group: all of its operations are posted together.

Gloo's isend returns at once and its pairs match messages in any order, so a hand-ordered exchange whose sends and
receives two ranks post in different orders passes on gloo and hangs under NCCL; here it hangs as well. The receiver announces each receive with a token on a second
gloo group; the sender waits for that token before it sends.
"""

import faulthandler
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_NAMES = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "init_process_group")
_real = {name: getattr(dist, name) for name in _NAMES}
_tokens = {}


def init_process_group(*args, **kwargs):
    _real["init_process_group"](*args, **kwargs)
    _tokens["group"] = _real_new_group(backend="gloo")  # every rank, in the same order: right after init


_real_new_group = dist.new_group


def _token_group():
    return _tokens["group"]


def _announce(src: int):  # a receive is posted: tell the sender (gloo's isend returns at once)
    return _real["isend"](torch.zeros(1), src, group=_token_group(), tag=77)


def _await_receiver(dst: int) -> None:  # block until the receiver has posted its receive
    _real["recv"](torch.zeros(1), dst, group=_token_group(), tag=77)


def _global(group, rank):
    return rank if group is None else dist.get_global_rank(group, rank)


class _Done:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    dst = _global(group, group_dst) if dst is None else dst
    _await_receiver(dst)
    return _real["send"](tensor, dst, group=group, tag=tag)


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    src = _global(group, group_src) if src is None else src
    token = _announce(src)
    got = _real["recv"](tensor, src, group=group, tag=tag)
    token.wait()
    return got


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    send(tensor, dst, group, tag, group_dst)  # issued in order on the one stream: runs to completion first
    return _Done()


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    recv(tensor, src, group, tag, group_src)
    return _Done()


def batch_isend_irecv(ops):
    # One group: every receive of the batch is posted (announced) before any send of it waits for its receiver.
    peer = [op.peer if op.peer is not None else _global(op.group, op.group_peer) for op in ops]
    works = [_announce(p) for op, p in zip(ops, peer) if op.op in (irecv, _real["irecv"])]
    for op, p in zip(ops, peer):
        if op.op in (isend, _real["isend"]):
            _await_receiver(p)
    for op, p in zip(ops, peer):
        if op.op in (isend, _real["isend"]):
            works.append(_real["isend"](op.tensor, p, group=op.group, tag=op.tag))
        else:
            works.append(_real["irecv"](op.tensor, p, group=op.group, tag=op.tag))
    return works


for _name in _NAMES:  # torch.distributed's names only: c10d's own functions keep calling the real ones
    setattr(dist, _name, globals()[_name])
_check_op = c10d._check_op
c10d._check_op = lambda op: None if op in (isend, irecv) else _check_op(op)  # P2POp(dist.isend, ...) is ours

if __name__ == "__main__":
    if os.environ.get("SYNC_P2P_DUMP"):  # seconds: then print every thread's stack and exit (finding a hang)
        faulthandler.dump_traceback_later(int(os.environ["SYNC_P2P_DUMP"]), exit=True)
    from titan_sft.train import main

    sys.exit(main(sys.argv[1:]))
