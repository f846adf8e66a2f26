package pciaddr

import "testing"

func TestNormalize(t *testing.T) {
	tests := []struct {
		in, want string
		wantErr  bool
	}{
		{"00000000:18:00.0", "0000:18:00.0", false}, // NVML busId
		{"00000000:B8:00.0", "0000:b8:00.0", false}, // NVML upper-case hex
		{"0000:B8:00.0", "0000:b8:00.0", false},     // NVML busIdLegacy / CUDA
		{"0000:b8:00.0", "0000:b8:00.0", false},     // sysfs
		{"b8:00.0", "0000:b8:00.0", false},          // lspci short form
		{" 0000:17:00.1\n", "0000:17:00.1", false},  // sysfs file content
		{"00000001:3A:1F.7", "0001:3a:1f.7", false}, // non-zero domain
		{"0000c3d2:00:00.0", "c3d2:00:00.0", false}, // Hyper-V style domain
		{"12345678:01:02.3", "12345678:01:02.3", false},
		{"", "", true},
		{"0000:18:00", "", true},        // no function
		{"0000:18:20.0", "", true},      // device > 0x1f
		{"0000:18:00.8", "", true},      // function > 7
		{"0000:118:00.0", "", true},     // 3-digit bus
		{"123456789:18:00.0", "", true}, // 9-digit domain
		{"0000:zz:00.0", "", true},
		{"mlx5_0", "", true},
		{"0000:18:00.0:1", "", true},
	}
	for _, tc := range tests {
		got, err := Normalize(tc.in)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("Normalize(%q) = %q, %v; want %q (error %v)", tc.in, got, err, tc.want, tc.wantErr)
		}
	}
}

func TestEqual(t *testing.T) {
	if !Equal("00000000:B8:00.0", "0000:b8:00.0") {
		t.Error("NVML and sysfs forms of one address differ")
	}
	if Equal("0000:b8:00.0", "0000:b8:00.1") || Equal("bogus", "bogus") {
		t.Error("Equal matched different or invalid addresses")
	}
}

func FuzzNormalize(f *testing.F) {
	for _, s := range []string{"00000000:B8:00.0", "b8:00.0", "0000:18:1f.7", "::."} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := Normalize(s)
		if err != nil {
			return
		}
		again, err := Normalize(n)
		if err != nil || again != n {
			t.Fatalf("Normalize not idempotent: %q -> %q -> %q, %v", s, n, again, err)
		}
	})
}
