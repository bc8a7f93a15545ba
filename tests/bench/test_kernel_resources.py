"""scripts/kernel_resources.py: reading ptxas's report, Mosaic's dump folder and a disassembly's key-block loops
(texts as ptxas, Mosaic and nvdisasm wrote them for the eighteenth session's compilations), and its arguments. The
compilation itself needs jax >= 0.11 with its CUDA plugin, which the test environment does not install; it was run
by hand (docs/benchmarks.md, eighteenth session)."""
import pytest

from mnemojax.bench import kernel_resources as kr

# ptxas -v of the two-consumer prefill kernel with 128-key blocks at head dim 128 (jax 0.11.2, sm_90a)
SPILLING = """ptxas warning : Registers are spilled to local memory in function 'paged_attention_mosaic_mosaic_gpu_kernel', 536 bytes spill stores, 676 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'paged_attention_mosaic_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for paged_attention_mosaic_mosaic_gpu_kernel
    368 bytes stack frame, 536 bytes spill stores, 676 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 368 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compile time = 310.250 ms
"""
CLEAN = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'paged_attention_merge_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for paged_attention_merge_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 163 registers, used 2 barriers, 1 bytes smem
ptxas info    : Compile time = 41.119 ms
"""
RESOURCES = ("Resources(smem_scratch_bytes=201728, tmem_scratch_cols=0, tmem_collective_scratch_cols=0, "
             "barrier_counts=Counter({Barrier(arrival_count=256, num_barriers=2, orders_tensor_core=False): 2}), "
             "scoped_gmem_semaphores={})")


def test_ptxas_report_gives_registers_stack_and_spills():
    assert kr.read_ptxas(SPILLING) == (168, 368, 536, 676)
    assert kr.read_ptxas(CLEAN) == (163, 0, 0, 0)
    with pytest.raises(ValueError, match="not a ptxas report"):
        kr.read_ptxas("ptxas info    : 0 bytes gmem\n")


def test_dump_folder_lists_kernels_in_compile_order(tmp_path):
    """Mosaic names its dumps <kernel>_<n>, n counting the kernels it compiled; the merge kernel reports no
    resources file here, so its SMEM is unknown (-)."""
    (tmp_path / "paged_attention_merge_3.ptxas").write_text(CLEAN)
    (tmp_path / "paged_attention_mosaic_2.ptxas").write_text(SPILLING)
    (tmp_path / "paged_attention_mosaic_2.resources.txt").write_text(RESOURCES)
    (tmp_path / "paged_attention_mosaic_2.ptx").write_text("// not read")
    got = kr.read_dump(str(tmp_path))
    assert [(k.name, k.index, k.registers, k.spill_stores, k.spill_loads, k.stack, k.smem) for k in got] == [
        ("paged_attention_mosaic", 2, 168, 536, 676, 368, 201728),
        ("paged_attention_merge", 3, 163, 0, 0, 0, None)]


def test_programs_an_sm_take_the_tightest_of_registers_threads_and_smem():
    """Hopper's limits, by hand: registers rounded up to 8 a thread, of 65,536; threads of 2,048; SMEM plus 1 KB a
    block, of 233,472 bytes; 32 blocks."""
    assert kr.programs_an_sm(181, 256, 152576) == 1  # 184 x 256 = 47,104 registers; 153,600 bytes
    assert kr.programs_an_sm(181, 256, 46080) == 1  # the registers alone hold it to one
    assert kr.programs_an_sm(126, 256, 78848) == 2  # 128 x 256 = 32,768: two; 79,872 bytes: two
    assert kr.programs_an_sm(129, 256, 46080) == 1  # 136 x 256 = 34,816: one
    assert kr.programs_an_sm(126, 256, 116736) == 1  # two by registers, one by SMEM: 2 x 117,760 > 233,472
    assert kr.programs_an_sm(32, 128, None) == 16  # 16 x 4,096 registers; SMEM not counted
    assert kr.programs_an_sm(16, 32, 0) == 32  # the blocks' limit
    assert kr.programs_an_sm(40, 1024, 0) == 1  # 40 x 1,024 = 40,960 registers


def test_dump_folder_gives_a_programs_threads_from_its_ptx(tmp_path):
    (tmp_path / "paged_attention_mosaic_0.ptxas").write_text(CLEAN.replace("merge", "mosaic"))
    (tmp_path / "paged_attention_mosaic_0.ptx").write_text(".visible .entry paged_attention_mosaic_mosaic_gpu_kernel("
                                                           "\n)\n.maxntid 256, 1, 1\n.minnctapersm 1\n{\n}\n")
    (tmp_path / "paged_attention_merge_1.ptxas").write_text(CLEAN)
    (tmp_path / "paged_attention_merge_1.ptx").write_text("// no .maxntid\n")
    assert [k.threads for k in kr.read_dump(str(tmp_path))] == [256, None]


def test_decode_waves_check_says_when_the_compiled_kernel_fits_fewer_programs_than_planned():
    """The default kernel's decode rows only (label `mosaic`, chunk 1, the attention kernel): at head dim 64 the
    plan assumes two programs an SM (33 partitions x 8 kv heads = 264 = 2 x 132 SMs); 126 registers keep two, 129
    (rounded to 136) leave one, so 264 programs take two waves."""
    def report(registers):
        return kr.KernelReport("paged_attention_mosaic", registers, 0, 0, 0, 78848, threads=256)

    merge = kr.KernelReport("paged_attention_merge", 200, 0, 0, 0, 76800, threads=128)
    rows = [("mosaic", 1, report(126)), ("mosaic", 1, merge), ("mosaic+stages=2", 1, report(129)),
            ("mosaic", 32, report(129)), ("mosaic", 1, "ValueError: does not lower")]
    lines = kr.check_decode_waves(rows, num_kv_heads=8, head_dim=64)
    assert lines == ["decode programs an SM at head dim 64: the plan assumes 2, the compiled kernel fits 2 (126 "
                     "registers x 256 threads, 78848 bytes of SMEM): as planned"]
    lines = kr.check_decode_waves([("mosaic", 1, report(129))], num_kv_heads=8, head_dim=64)
    assert lines == ["decode programs an SM at head dim 64: the plan assumes 2, the compiled kernel fits 1 (129 "
                     "registers x 256 threads, 78848 bytes of SMEM): FEWER than planned: the default 33 partitions "
                     "x 8 kv heads make 2 waves of programs on 132 SMs, not one"]


# A disassembly's shape, trimmed: a prologue, an outer loop (.L_x_1) around two key-block loops, the first
# (.L_x_2) clean, the second (.L_x_3) masking and spilling, and an epilogue loop (.L_x_4) with no wgmma.
SASS = """        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1+0xd0], R10 ;
.L_x_1:
        /*0020*/                   IMAD R2, R2, 0x2, RZ ;
.L_x_2:
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0050*/                   MUFU.EX2 R5, R5 ;
        /*0060*/                   MUFU.EX2 R6, R6 ;
        /*0070*/              @!P1 BRA `(.L_x_2) ;
.L_x_3:
        /*0080*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT ;
        /*0090*/                   LDL R7, [R1+0x10] ;
        /*0098*/                   FSEL R5, R5, -1e30, P0 ;
        /*00a0*/                   MUFU.EX2 R5, R5 ;
        /*00b0*/                   STL [R1+0x14], R8 ;
        /*00c0*/                   LDL R9, [R1+0x18] ;
        /*00d0*/              @!P2 BRA `(.L_x_3) ;
        /*00e0*/               @P3 BRA `(.L_x_1) ;
.L_x_4:
        /*00f0*/                   LDL R9, [R1+0x18] ;
        /*0100*/               @P4 BRA `(.L_x_4) ;
        /*0110*/                   EXIT ;
"""


def test_key_block_loops_are_the_innermost_that_issue_wgmma():
    """(instructions, HGMMA, MUFU.EX2, FSEL, STL, LDL) of each innermost loop holding wgmma: the outer loop (around
    both) and the epilogue's loop (no wgmma) are not counted; spills outside the loops neither. The second loop
    selects (masks). Its instructions run from the label to the back edge: 5 and 7."""
    assert kr.sass_loops(SASS) == [(5, 2, 2, 0, 0, 0), (7, 1, 1, 1, 1, 2)]


# ptxas's outlining of an mbarrier wait: the retry sits after the function's EXIT and branches back into the middle
# of the loop; and a loop with two back edges (a `continue`) to its label
OUTLINED = """.L_x_1:
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT ;
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R106 ;
        /*0020*/              @!P1 BRA `(.L_x_9) ;
.L_x_2:
        /*0030*/                   MUFU.EX2 R5, R5 ;
        /*0040*/              @P2 BRA `(.L_x_1) ;
        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0060*/              @P3 BRA `(.L_x_1) ;
        /*0070*/                   LDL R9, [R1+0x18] ;
        /*0080*/                   EXIT ;
.L_x_9:
        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R106 ;
        /*00a0*/              @!P1 BRA `(.L_x_9) ;
        /*00b0*/                   BRA `(.L_x_2) ;
"""


def test_an_outlined_wait_and_a_second_back_edge_make_no_loop_of_their_own():
    """The retry's branch back to .L_x_2 crosses the EXIT: no loop (it would span the loop's tail, the LDL after it
    and the EXIT); the loop is .L_x_1 to its furthest back edge, once."""
    assert kr.sass_loops(OUTLINED) == [(7, 2, 1, 0, 0, 0)]


def test_arguments():
    args = kr.parse_args(["--impl", "mosaic,mosaic+max_registers=false", "--chunks", "1,2048", "--model",
                          "llama3.2-1b"])
    assert args.impls == ["mosaic", "mosaic+max_registers=false"] and args.chunk_list == [1, 2048]
    assert (args.context, args.target, args.sass) == (1 << 20, "h100", False)
    assert kr.parse_args(["--impl", "mosaic,attention_mgpu"]).impls == ["mosaic", kr.ATTENTION_MGPU]
    for bad in (["--chunks", "0"], ["--chunks", "two"], ["--chunks", "4096", "--context", "2048"],
                ["--impl", "mosaic,pallas"], ["--impl", "mosaic+fast"]):
        with pytest.raises(SystemExit):
            kr.parse_args(bad)


def test_a_label_that_fails_is_reported_and_the_others_still_run(monkeypatch, capsys):
    """main: each (label, chunk) compiled on its own; one that raises gets a "failed" row, the table still prints
    (the compilation stands in: it writes the dump Mosaic would); jax's compilation cache, off meanwhile, is left
    as it was."""
    import jax

    from mnemojax.bench import aot_step

    def fake_compile(*, label, chunk, folder, **_):
        if "overlap" in label:
            raise ValueError("does not lower")
        with open(f"{folder}/paged_attention_mosaic_0.ptxas", "w") as f:
            f.write(SPILLING if "max_registers=false" in label else CLEAN.replace("merge", "mosaic"))

    class Device:
        device_kind = "NVIDIA H100 80GB HBM3"

    monkeypatch.setattr(kr, "compile_layer", fake_compile)
    monkeypatch.setattr(aot_step, "target_devices", lambda target, count: [Device()])
    cache = jax.config.jax_enable_compilation_cache
    kr.main(["--impl", "mosaic+max_registers=false,mosaic+overlap=true,mosaic", "--chunks", "2048"])
    assert jax.config.jax_enable_compilation_cache == cache
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:-1]]
    assert [r[:6] for r in rows] == [
        ["mosaic+max_registers=false", "2048", "paged_attention_mosaic", "168", "536", "676"],
        ["mosaic+overlap=true", "2048", "failed:", "ValueError:", "does", "not"],
        ["mosaic", "2048", "paged_attention_mosaic", "163", "0", "0"]]


def test_attention_mgpu_takes_multiples_of_128(tmp_path):
    """jax's `attention_mgpu` (the `attention_mgpu` label: its hot loop beside ours) tiles q and the keys by 128: a
    decode or a 32-token chunk is refused by name (a "failed" row in the table), before anything compiles."""
    import jax

    for chunk, context in ((1, 1 << 20), (32, 1 << 20), (2048, 1000)):
        with pytest.raises(ValueError, match="attention_mgpu takes chunks and contexts of multiples of 128"):
            kr.compile_layer(label=kr.ATTENTION_MGPU, chunk=chunk, context=context, num_heads=32, num_kv_heads=8,
                             head_dim=128, page_size=16, device=jax.devices("cpu")[0], folder=str(tmp_path))
