// Package pciaddr normalises PCI addresses between the forms kvxfer meets:
// NVML's bus id (8 hex digit domain, upper-case: "00000000:B8:00.0"), CUDA's
// and sysfs's (4 digit domain, lower-case: "0000:b8:00.0"), and lspci's short
// form without a domain ("b8:00.0"). Facts: the Linux PCI sysfs ABI names
// devices "%04x:%02x:%02x.%d" (domain:bus:device.function); NVML documents
// nvmlPciInfo_t.busId as "domain:bus:device.function" with an 8 hex digit
// domain.
package pciaddr

import (
	"fmt"
	"strconv"
	"strings"
)

// Normalize returns addr in the sysfs form "dddd:bb:dd.f" (lower-case hex, a
// domain of at least 4 digits, more only when its value needs them). It
// accepts surrounding spaces, upper or lower case, a 1-8 digit domain or none
// (domain 0). Errors name the input and the part that is wrong.
func Normalize(addr string) (string, error) {
	s := strings.ToLower(strings.TrimSpace(addr))
	bad := func(why string) (string, error) {
		return "", fmt.Errorf("pci address %q: %s (want domain:bus:device.function, e.g. 0000:18:00.0)", addr, why)
	}
	parts := strings.Split(s, ":")
	var domain uint64
	switch len(parts) {
	case 2:
	case 3:
		if len(parts[0]) == 0 || len(parts[0]) > 8 {
			return bad("domain must be 1-8 hex digits")
		}
		d, err := strconv.ParseUint(parts[0], 16, 32)
		if err != nil {
			return bad("domain is not hex")
		}
		domain = d
		parts = parts[1:]
	default:
		return bad("wrong number of ':' separators")
	}
	if len(parts[0]) == 0 || len(parts[0]) > 2 {
		return bad("bus must be 1-2 hex digits")
	}
	bus, err := strconv.ParseUint(parts[0], 16, 8)
	if err != nil {
		return bad("bus is not hex")
	}
	devFn := strings.Split(parts[1], ".")
	if len(devFn) != 2 || len(devFn[0]) == 0 || len(devFn[0]) > 2 || len(devFn[1]) != 1 {
		return bad("device.function must look like 00.0")
	}
	dev, err := strconv.ParseUint(devFn[0], 16, 8)
	if err != nil || dev > 0x1f {
		return bad("device must be hex 00-1f")
	}
	fn, err := strconv.ParseUint(devFn[1], 10, 8)
	if err != nil || fn > 7 {
		return bad("function must be 0-7")
	}
	return fmt.Sprintf("%04x:%02x:%02x.%d", domain, bus, dev, fn), nil
}

// Equal reports whether a and b name the same PCI function in any accepted
// form (false if either does not parse).
func Equal(a, b string) bool {
	na, err := Normalize(a)
	if err != nil {
		return false
	}
	nb, err := Normalize(b)
	return err == nil && na == nb
}
